"""The gRPC edge against a real in-process daemon: status codes, versions, socket modes, tokens and rights.

Every daemon is stopped and every channel closed in fixture finalizers (this folder's `conftest.py`),
so a failing assertion leaves no server thread or socket behind.
"""
from __future__ import annotations

import os
import stat

import grpc
import pytest

from crossover.daemon.api import FailedPrecondition, InvalidRequest
from crossover.daemon.server import Daemon, Endpoints
from crossover.protos import PROTOCOL_VERSION as VERSION
from crossover.protos import TOKEN_METADATA_KEY
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from tests.integration.rpc._world import identity, make_core, register, rpc_error, wait_for

pytestmark = pytest.mark.timeout(60)


def test_bad_requests_get_clear_statuses_and_the_daemon_keeps_serving(serve, channels, sessions, tmp_path):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))

    err = rpc_error(stub.Register, pb.RegisterRequest(protocol_version=1, identity=identity()), timeout=5)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION  # a plugin from before protocol 2
    assert "protocol_version=1" in err.details() and f"speaks {VERSION}" in err.details()

    err = rpc_error(stub.Register, pb.RegisterRequest(protocol_version=VERSION), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "identity" in err.details()

    err = rpc_error(register, stub, rank=5, world=2)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "rank=5" in err.details()

    err = rpc_error(register, stub, device=7)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "device=7" in err.details()

    reg = register(stub, job="twice")
    err = rpc_error(register, stub, job="twice")
    assert err.code() is grpc.StatusCode.ALREADY_EXISTS and "already registered" in err.details()

    # a stream whose first event is not OPEN
    err = rpc_error(lambda: list(stub.Session(iter([pb.RankEvent(kind=pb.HEARTBEAT)]), timeout=5)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "OPEN" in err.details()

    # OPEN without a session id
    err = rpc_error(lambda: list(stub.Session(iter([pb.RankEvent(kind=pb.OPEN)]), timeout=5)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    # OPEN naming a session the daemon never issued
    err = rpc_error(lambda: list(stub.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id="forged")]), timeout=5)))
    assert err.code() is grpc.StatusCode.NOT_FOUND and "forged" in err.details()

    # COMPUTE_DONE without a grant ends that stream only
    events = [pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), pb.RankEvent(kind=pb.COMPUTE_DONE)]
    err = rpc_error(lambda: list(stub.Session(iter(events), timeout=5)))
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "holds no grant" in err.details()

    # an unspecified event kind after OPEN is refused as well
    reg2 = register(stub, job="kind0")
    events = [pb.RankEvent(kind=pb.OPEN, session_id=reg2.session_id), pb.RankEvent(kind=pb.EVENT_KIND_UNSPECIFIED)]
    err = rpc_error(lambda: list(stub.Session(iter(events), timeout=5)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    # the offending sessions are gone: their ranks may register again
    wait_for(lambda: not any(r.ident.job_name in ("twice", "kind0") for r in d.core.steering.snapshot()[1]))

    # after all that, a well-behaved client still works end to end
    good = sessions(target, "good-job")
    assert good.attached and good.registration.policy == "exclusive"
    assert good.acquire(0) is True
    good.release(0, duration_s=0.01)
    wait_for(lambda: any(e.name == "release" and e.job_name == "good-job" for e in d.core.events.events()))
    assert [e.name for e in d.core.events.events() if e.job_name == "good-job"][:5] == [
        "register", "request", "grant", "lease", "release"]  # alone on its device: leased


def test_admin_rpcs_check_version_and_device(serve, channels):
    d = serve()
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    err = rpc_error(admin.GetQueue, pb.QueueRequest(protocol_version=0, device=-1), timeout=5)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "protocol_version=0" in err.details()
    err = rpc_error(admin.GetQueue, pb.QueueRequest(protocol_version=VERSION, device=3), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, name=""), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "name" in err.details()
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, name="bogus"), timeout=5)
    assert err.code() is grpc.StatusCode.NOT_FOUND and "exclusive" in err.details()
    err = rpc_error(admin.Drain, pb.DeviceRequest(protocol_version=VERSION, device=9), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    q = admin.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=1), timeout=5)
    assert [dev.index for dev in q.devices] == [1] and q.node == "node-rpc" and q.policy == "exclusive"
    info = admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name="passthrough"), timeout=5)
    assert info.name == "passthrough" and "exclusive" in info.available
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, adapt=7), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "ADAPT_ON" in err.details()
    info = admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, adapt=pb.ADAPT_ON), timeout=5)
    assert info.name == "passthrough" and info.adapt  # the policy is kept, adapt switched on
    assert not admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, adapt=pb.ADAPT_OFF), timeout=5).adapt
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, protect=1.5), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "0..1" in err.details()
    info = admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, protect=0.0), timeout=5)
    assert info.name == "passthrough" and info.protect == 0.0  # the policy is kept, the controller off
    assert admin.GetPolicy(pb.PolicyRequest(protocol_version=VERSION), timeout=5).protect == 0.0


def test_socket_is_not_world_accessible(serve, tmp_path):
    sock = tmp_path / "run" / "xo" / "d.sock"
    d = serve(socket=sock)
    mode = os.stat(d.socket_path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) & 0o007 == 0


def test_socket_path_that_is_a_regular_file_is_not_replaced(tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    made: list[Daemon] = []
    try:
        with pytest.raises(FailedPrecondition, match="not a socket"):
            made.append(Daemon(make_core(), Endpoints(socket_path=str(path))))  # refused here or at start()
            made[0].start()
    finally:
        for d in made:
            d.stop(grace=0.1)
    assert path.read_text() == "precious"


def test_stale_socket_is_replaced(serve, tmp_path, channels):
    first = serve(socket=tmp_path / "s.sock")
    first.stop(grace=0.1)
    d = serve(socket=tmp_path / "s.sock")
    admin = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    assert admin.GetPolicy(pb.PolicyRequest(protocol_version=VERSION), timeout=5).name == "exclusive"


def test_tcp_needs_the_token(serve, channels, tmp_path):
    d = serve(socket=tmp_path / "t.sock", listen="127.0.0.1:0", token="s3cret")
    assert d.port
    tcp = channels(f"127.0.0.1:{d.port}")
    admin = pb_grpc.AdminStub(tcp)
    req = pb.QueueRequest(protocol_version=VERSION, device=-1)

    err = rpc_error(admin.GetQueue, req, timeout=5)
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED and TOKEN_METADATA_KEY in err.details()
    err = rpc_error(admin.GetQueue, req, timeout=5, metadata=[(TOKEN_METADATA_KEY, "wrong")])
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED
    ok = admin.GetQueue(req, timeout=5, metadata=[(TOKEN_METADATA_KEY, "s3cret")])
    assert ok.node == "node-rpc" and len(ok.devices) == 2

    sched = pb_grpc.SchedulerStub(tcp)
    err = rpc_error(register, sched)
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(lambda: list(sched.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id="x")]), timeout=5)))
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED

    # the Unix socket is trusted (its mode guards it): no token needed there
    unix = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    assert unix.GetQueue(req, timeout=5).node == "node-rpc"


@pytest.mark.parametrize("token", [None, "wrong", "s3cre", "s3cret-and-more"])
def test_tcp_calls_without_the_right_token_change_nothing(serve, channels, tmp_path, token):
    """Every RPC over TCP without the right token is refused before any handler runs."""
    d = serve(socket=tmp_path / "t.sock", listen="127.0.0.1:0", token="s3cret", admin_token="4dmin")
    tcp = channels(f"127.0.0.1:{d.port}")
    admin, sched = pb_grpc.AdminStub(tcp), pb_grpc.SchedulerStub(tcp)
    md = [(TOKEN_METADATA_KEY, token)] if token is not None else []
    calls = {
        "SetPolicy": lambda: admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name="passthrough"),
                                             timeout=5, metadata=md),
        "Drain": lambda: admin.Drain(pb.DeviceRequest(protocol_version=VERSION, device=1), timeout=5, metadata=md),
        "Resume": lambda: admin.Resume(pb.DeviceRequest(protocol_version=VERSION, device=1), timeout=5, metadata=md),
        "GetQueue": lambda: admin.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1), timeout=5,
                                           metadata=md),
        "ListJobs": lambda: admin.ListJobs(pb.JobsRequest(protocol_version=VERSION), timeout=5, metadata=md),
        "GetPolicy": lambda: admin.GetPolicy(pb.PolicyRequest(protocol_version=VERSION), timeout=5, metadata=md),
        "Register": lambda: register(sched, job="intruder", metadata=md),
        "Session": lambda: list(sched.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id="x")]), timeout=5,
                                              metadata=md)),
    }
    for name, call in calls.items():
        err = rpc_error(call)
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED, f"{name}: {err.code()}"
    assert d.core.steering.policy_name == "exclusive"
    unix = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    state = unix.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1), timeout=5)
    assert [dev.draining for dev in state.devices] == [False, False]
    assert unix.ListJobs(pb.JobsRequest(protocol_version=VERSION), timeout=5).jobs == []
    assert not any(e.name in ("register", "policy", "drain", "resume") for e in d.core.events.events())
    rank_token = [(TOKEN_METADATA_KEY, "s3cret")]  # every rank holds it: it may look, not steer
    err = rpc_error(admin.Drain, pb.DeviceRequest(protocol_version=VERSION, device=1), timeout=5, metadata=rank_token)
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
    policy = admin.GetPolicy(pb.PolicyRequest(protocol_version=VERSION), timeout=5, metadata=rank_token)
    assert policy.name == "exclusive"
    assert not d.core.steering.is_draining(1)
    admin.Drain(pb.DeviceRequest(protocol_version=VERSION, device=1), timeout=5,
                metadata=[(TOKEN_METADATA_KEY, "4dmin")])
    assert [dev.draining for dev in unix.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1),
                                                  timeout=5).devices] == [False, True]


def test_over_tcp_without_an_admin_token_nobody_steers(serve, channels, tmp_path):
    d = serve(listen="127.0.0.1:0", token="s3cret")
    admin = pb_grpc.AdminStub(channels(f"127.0.0.1:{d.port}"))
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, name="passthrough"), timeout=5,
                    metadata=[(TOKEN_METADATA_KEY, "s3cret")])
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in err.details()
    assert d.core.steering.policy_name == "exclusive"


def test_the_rank_socket_refuses_admin_calls_and_the_admin_socket_is_the_owners_alone(serve, channels):
    d = serve(policy="exclusive")
    assert stat.S_IMODE(os.stat(d.admin_socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o660
    rank_side = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    for call, req in ((rank_side.SetPolicy, pb.PolicyRequest(protocol_version=VERSION, name="passthrough")),
                      (rank_side.Drain, pb.DeviceRequest(protocol_version=VERSION, device=0)),
                      (rank_side.Resume, pb.DeviceRequest(protocol_version=VERSION, device=0))):
        err = rpc_error(call, req, timeout=5)
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED and d.admin_socket in err.details()
    assert rank_side.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1), timeout=5).policy == "exclusive"
    assert d.core.steering.policy_name == "exclusive" and not d.core.steering.is_draining(0)
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    assert admin.Drain(pb.DeviceRequest(protocol_version=VERSION, device=0), timeout=5).draining
    reply = admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name="passthrough"), timeout=5)
    assert reply.name == "passthrough"


def test_tcp_only_daemon_with_token(serve, channels):
    d = serve(listen="127.0.0.1:0", token="s3cret")
    assert d.socket_path is None
    admin = pb_grpc.AdminStub(channels(f"127.0.0.1:{d.port}"))
    info = admin.GetPolicy(pb.PolicyRequest(protocol_version=VERSION), timeout=5,
                           metadata=[(TOKEN_METADATA_KEY, "s3cret")])
    assert info.name == "exclusive"


def test_session_client_over_tcp_sends_its_token(serve, sessions):
    d = serve(listen="127.0.0.1:0", token="s3cret")
    s = sessions(f"127.0.0.1:{d.port}", "tcp-job", token="s3cret")
    assert s.attached
    assert s.acquire(0) is True
    s.release(0)


@pytest.mark.parametrize("token", [None, ""])
def test_listen_without_token_is_refused(token, tmp_path):
    with pytest.raises(InvalidRequest, match="token"):
        Daemon(make_core(), Endpoints(socket_path=str(tmp_path / "x.sock"), listen="127.0.0.1:0", token=token))
    assert not (tmp_path / "x.sock").exists()


def test_nothing_to_listen_on_is_refused():
    with pytest.raises(InvalidRequest, match="nothing to listen on"):
        Daemon(make_core(), Endpoints(socket_path=None))
