"""The gRPC edge against a real in-process daemon: status codes, auth, socket mode, liveness.

Every daemon is stopped and every channel closed in fixture finalizers, so a
failing assertion leaves no server thread or socket behind.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crossover.client.session import RankInfo, Session
from crossover.client.settings import PluginSettings
from crossover.daemon.api import FailedPrecondition, InvalidRequest
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.limits import StreamLimits
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.server import Daemon
from crossover.protos import TOKEN_METADATA_KEY, framing
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

_END = object()


def make_core(**kw) -> Scheduler:
    inv = Inventory([Device(0, "cpu", "cpu0", (0,)), Device(1, "cpu", "cpu1", (1,))])
    kw.setdefault("heartbeat_interval_s", 0.1)
    kw.setdefault("heartbeat_timeout_s", 0.8)
    return Scheduler(inv, kw.pop("policy", "exclusive"), node="node-rpc", event_log=EventLog(), **kw)


@pytest.fixture
def serve(tmp_path):
    """`serve(**scheduler_kw)` → a started Daemon on a temp socket; stopped at teardown."""
    daemons: list[Daemon] = []

    def start(socket: Path | None = None, listen: str | None = None, token: str | None = None,
              session_socket: bool = True, limits: StreamLimits | None = None, admin_token: str | None = None,
              **core_kw) -> Daemon:
        sock = None if listen and socket is None else str(socket or tmp_path / "d.sock")
        d = Daemon(make_core(**core_kw), socket_path=sock, listen=listen, token=token, reap_interval_s=0.05,
                   session_socket=session_socket, limits=limits, admin_token=admin_token)
        daemons.append(d)
        return d.start()

    yield start
    for d in daemons:
        d.stop(grace=0.5)


@pytest.fixture
def channels():
    """`open(target)` → a grpc channel closed at teardown."""
    opened: list[grpc.Channel] = []

    def open_(target: str) -> grpc.Channel:
        ch = grpc.insecure_channel(target)
        opened.append(ch)
        return ch

    yield open_
    for ch in opened:
        ch.close()


@pytest.fixture
def streams():
    """Hand-driven Session streams: `open(stub)` → (request queue, response iterator).

    Requests are read from the queue until `_END`, so a stream stays open (and
    silent) as long as the test wants; teardown ends every one of them.
    """
    opened: list[tuple[queue.SimpleQueue, grpc.Call]] = []

    def open_(stub: pb_grpc.SchedulerStub, *first: pb.RankEvent, metadata=()) -> tuple[queue.SimpleQueue, grpc.Call]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        for ev in first:
            q.put(ev)

        def requests() -> Iterator[pb.RankEvent]:
            while (item := q.get()) is not _END:
                yield item

        call = stub.Session(requests(), metadata=metadata, timeout=20)
        opened.append((q, call))
        return q, call

    yield open_
    for q, call in opened:
        q.put(_END)
        call.cancel()


@pytest.fixture
def sessions():
    """Real `crossover.client.session.Session` clients, closed at teardown."""
    made: list[Session] = []

    def make(target: str, job: str, rank: int = 0, world: int = 1, **kw) -> Session:
        settings = PluginSettings(target=target, token=kw.pop("token", ""), job_name=job, device=kw.pop("device", 0),
                                  grant_timeout_s=kw.pop("grant_timeout_s", 5.0),
                                  connect_timeout_s=kw.pop("connect_timeout_s", 2.0), reconnect_interval_s=30.0,
                                  pin=False, transport=kw.pop("transport", "auto"),
                                  cool_off_s=kw.pop("cool_off_s", 10.0))
        info = RankInfo(job_id=f"id-{job}", job_name=job, rank=rank, local_rank=rank, world_size=world,
                        local_size=world, device=settings.device)
        s = Session(info, settings)
        made.append(s)
        return s.start()

    yield make
    for s in made:
        s.close()


def identity(job: str = "job-x", rank: int = 0, world: int = 2, device: int = 0, pid: int | None = None):
    return pb.RankIdentity(job_id=f"id-{job}", job_name=job, rank=rank, local_rank=rank, world_size=world,
                           local_size=world, node="n", device=device, pid=pid or os.getpid())


def register(stub: pb_grpc.SchedulerStub, metadata=None, **kw) -> pb.RegisterResponse:
    return stub.Register(pb.RegisterRequest(protocol_version=1, identity=identity(**kw)), timeout=5,
                         metadata=metadata)


def holding_stream(stub: pb_grpc.SchedulerStub, streams, job: str) -> tuple[queue.SimpleQueue, grpc.Call]:
    """A 1-rank job's raw stream that asked for device 0 and was granted it (it holds it until told)."""
    reg = register(stub, job=job, world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, seq=1))
    assert first_directive(call).grant.seq == 1
    return q, call


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    return err.value


def first_directive(call: grpc.Call, timeout: float = 5.0) -> pb.Directive:
    """Next directive from a stream but for device-share news and heartbeat answers, with a bound;
    runs the blocking `next` in a helper thread."""
    box: queue.SimpleQueue = queue.SimpleQueue()

    def take() -> None:
        d = next(call, None)
        while d is not None and (d.HasField("share") or d.HasField("alive")):
            d = next(call, None)
        box.put(d)

    threading.Thread(target=take, daemon=True).start()
    return box.get(timeout=timeout)


def test_bad_requests_get_clear_statuses_and_the_daemon_keeps_serving(serve, channels, sessions, tmp_path):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))

    err = rpc_error(stub.Register, pb.RegisterRequest(protocol_version=2, identity=identity()), timeout=5)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol_version=2" in err.details() and "speaks 1" in err.details()

    err = rpc_error(stub.Register, pb.RegisterRequest(protocol_version=1), timeout=5)
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
    wait_for(lambda: not any(r.ident.job_name in ("twice", "kind0") for r in d.core.snapshot()[1]))

    # after all that, a well-behaved client still works end to end
    good = sessions(target, "good-job")
    assert good.attached and good.registration.policy == "exclusive"
    assert good.acquire(0) is True
    good.release(0, duration_s=0.01)
    wait_for(lambda: any(e["event"] == "release" and e["job_name"] == "good-job" for e in d.core.events.snapshot()))
    assert [e["event"] for e in d.core.events.snapshot() if e.get("job_name") == "good-job"][:5] == [
        "register", "request", "grant", "lease", "release"]  # alone on its device: leased


def test_admin_rpcs_check_version_and_device(serve, channels):
    d = serve()
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    err = rpc_error(admin.GetQueue, pb.QueueRequest(protocol_version=0, device=-1), timeout=5)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "protocol_version=0" in err.details()
    err = rpc_error(admin.GetQueue, pb.QueueRequest(protocol_version=1, device=3), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=1, name=""), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "name" in err.details()
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=1, name="bogus"), timeout=5)
    assert err.code() is grpc.StatusCode.NOT_FOUND and "exclusive" in err.details()
    err = rpc_error(admin.Drain, pb.DeviceRequest(protocol_version=1, device=9), timeout=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    q = admin.GetQueue(pb.QueueRequest(protocol_version=1, device=1), timeout=5)
    assert [dev.index for dev in q.devices] == [1] and q.node == "node-rpc" and q.policy == "exclusive"
    info = admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name="passthrough"), timeout=5)
    assert info.name == "passthrough" and "exclusive" in info.available


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
            made.append(Daemon(make_core(), socket_path=str(path)))  # refused here or at start()
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
    assert admin.GetPolicy(pb.PolicyRequest(protocol_version=1), timeout=5).name == "exclusive"


def test_tcp_needs_the_token(serve, channels, tmp_path):
    d = serve(socket=tmp_path / "t.sock", listen="127.0.0.1:0", token="s3cret")
    assert d.port
    tcp = channels(f"127.0.0.1:{d.port}")
    admin = pb_grpc.AdminStub(tcp)
    req = pb.QueueRequest(protocol_version=1, device=-1)

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
        "SetPolicy": lambda: admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name="passthrough"),
                                             timeout=5, metadata=md),
        "Drain": lambda: admin.Drain(pb.DeviceRequest(protocol_version=1, device=1), timeout=5, metadata=md),
        "Resume": lambda: admin.Resume(pb.DeviceRequest(protocol_version=1, device=1), timeout=5, metadata=md),
        "GetQueue": lambda: admin.GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=5, metadata=md),
        "ListJobs": lambda: admin.ListJobs(pb.JobsRequest(protocol_version=1), timeout=5, metadata=md),
        "GetPolicy": lambda: admin.GetPolicy(pb.PolicyRequest(protocol_version=1), timeout=5, metadata=md),
        "Register": lambda: register(sched, job="intruder", metadata=md),
        "TurnFloor": lambda: sched.TurnFloor(pb.TurnFloorRequest(session_id="x"), timeout=5, metadata=md),
        "Session": lambda: list(sched.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id="x")]), timeout=5,
                                              metadata=md)),
    }
    for name, call in calls.items():
        err = rpc_error(call)
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED, f"{name}: {err.code()}"
    assert d.core.policy_name == "exclusive"
    unix = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    state = unix.GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=5)
    assert [dev.draining for dev in state.devices] == [False, False]
    assert unix.ListJobs(pb.JobsRequest(protocol_version=1), timeout=5).jobs == []
    assert not any(e["event"] in ("register", "policy", "drain", "resume") for e in d.core.events.snapshot())
    rank_token = [(TOKEN_METADATA_KEY, "s3cret")]  # every rank holds it: it may look, not steer
    err = rpc_error(admin.Drain, pb.DeviceRequest(protocol_version=1, device=1), timeout=5, metadata=rank_token)
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
    assert admin.GetPolicy(pb.PolicyRequest(protocol_version=1), timeout=5, metadata=rank_token).name == "exclusive"
    assert not d.core.is_draining(1)
    admin.Drain(pb.DeviceRequest(protocol_version=1, device=1), timeout=5, metadata=[(TOKEN_METADATA_KEY, "4dmin")])
    assert [dev.draining for dev in unix.GetQueue(pb.QueueRequest(protocol_version=1, device=-1),
                                                  timeout=5).devices] == [False, True]


def test_over_tcp_without_an_admin_token_nobody_steers(serve, channels, tmp_path):
    d = serve(listen="127.0.0.1:0", token="s3cret")
    admin = pb_grpc.AdminStub(channels(f"127.0.0.1:{d.port}"))
    err = rpc_error(admin.SetPolicy, pb.PolicyRequest(protocol_version=1, name="passthrough"), timeout=5,
                    metadata=[(TOKEN_METADATA_KEY, "s3cret")])
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in err.details()
    assert d.core.policy_name == "exclusive"


def test_the_rank_socket_refuses_admin_calls_and_the_admin_socket_is_the_owners_alone(serve, channels):
    d = serve(policy="exclusive")
    assert stat.S_IMODE(os.stat(d.admin_socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o660
    rank_side = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    for call, req in ((rank_side.SetPolicy, pb.PolicyRequest(protocol_version=1, name="passthrough")),
                      (rank_side.Drain, pb.DeviceRequest(protocol_version=1, device=0)),
                      (rank_side.Resume, pb.DeviceRequest(protocol_version=1, device=0))):
        err = rpc_error(call, req, timeout=5)
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED and d.admin_socket in err.details()
    assert rank_side.GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=5).policy == "exclusive"
    assert d.core.policy_name == "exclusive" and not d.core.is_draining(0)
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    assert admin.Drain(pb.DeviceRequest(protocol_version=1, device=0), timeout=5).draining
    assert admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name="passthrough"), timeout=5).name == "passthrough"


def test_tcp_only_daemon_with_token(serve, channels):
    d = serve(listen="127.0.0.1:0", token="s3cret")
    assert d.socket_path is None
    admin = pb_grpc.AdminStub(channels(f"127.0.0.1:{d.port}"))
    info = admin.GetPolicy(pb.PolicyRequest(protocol_version=1), timeout=5, metadata=[(TOKEN_METADATA_KEY, "s3cret")])
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
        Daemon(make_core(), socket_path=str(tmp_path / "x.sock"), listen="127.0.0.1:0", token=token)
    assert not (tmp_path / "x.sock").exists()


def test_nothing_to_listen_on_is_refused():
    with pytest.raises(InvalidRequest, match="nothing to listen on"):
        Daemon(make_core(), socket_path=None)


def test_silent_rank_is_suspended_its_grant_goes_to_the_waiter_and_it_is_evicted_later(serve, channels, streams,
                                                                                       sessions):
    d = serve(heartbeat_timeout_s=0.5, evict_after_s=2.5)
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    reg = register(stub, job="silent", world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=41))
    grant = first_directive(call)
    assert grant.WhichOneof("kind") == "grant" and grant.grant.seq == 41
    # from here the silent rank sends nothing: no heartbeat, no release

    waiter = sessions(target, "patient")
    t0 = time.monotonic()
    assert waiter.acquire(0) is True  # blocks until the silent rank is suspended
    waited = time.monotonic() - t0
    assert waited < 1.0, f"grant took {waited:.2f}s to move to the waiting rank"
    # the daemon logs after it sends: the grant may arrive before the log has the suspension
    suspend = wait_for(lambda: [e for e in d.core.events.snapshot()
                                if e["event"] == "suspend" and e.get("job_name") == "silent"])
    assert "heartbeat" in suspend[0]["reason"] and suspend[0]["phase"] == "compute"
    silent_rank = [r for r in d.core.snapshot()[1] if r.ident.job_name == "silent"]
    assert [r.phase.value for r in silent_rank] == ["suspended"]
    waiter.release(0)

    first_directive(call, timeout=5.0)  # the stream ends once the silence passes --evict-after
    leave = wait_for(lambda: [e for e in d.core.events.snapshot()
                              if e["event"] == "leave" and e.get("job_name") == "silent"])
    assert "heartbeat" in leave[0]["reason"]
    assert time.monotonic() - t0 >= 2.0
    assert not any(r.ident.job_name == "silent" for r in d.core.snapshot()[1])
    # the waiter kept heartbeating through it all and is still registered
    assert any(r.ident.job_name == "patient" for r in d.core.snapshot()[1])


def test_a_starved_rank_that_speaks_again_carries_on_in_its_session(serve, channels, streams, sessions):
    d = serve(heartbeat_timeout_s=0.4, evict_after_s=30.0)
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    holder = sessions(target, "holder")
    assert holder.acquire(0) is True
    reg = register(stub, job="starved", world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=5))
    wait_for(lambda: [e for e in d.core.events.snapshot() if e["event"] == "suspend"], timeout=3.0)
    holder.release(0)
    time.sleep(0.2)
    assert [e for e in d.core.events.snapshot() if e["event"] == "grant" and e["job_name"] == "starved"] == []
    q.put(pb.RankEvent(kind=pb.HEARTBEAT))  # back: its old request is queued again and granted
    grant = first_directive(call)
    assert grant.WhichOneof("kind") == "grant" and grant.grant.seq == 5
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0))
    q.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=1, seq=6))
    assert first_directive(call).grant.seq == 6
    assert [e["event"] for e in d.core.events.snapshot() if e.get("job_name") == "starved"][:5] == [
        "register", "request", "suspend", "resume", "request"]


def test_stream_end_frees_the_grant(serve, channels, streams, sessions):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    q, call = holding_stream(stub, streams, "quitter")
    waiter = sessions(target, "next-in-line", grant_timeout_s=5.0)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(waiter.acquire(0)), daemon=True)
    t.start()
    wait_for(lambda: d.core.snapshot()[0][0][1])  # device 0 has a waiting rank
    q.put(_END)  # the client half-closes its stream: the daemon must free the grant at once
    t.join(timeout=3)
    assert result == [True]
    waiter.release(0)


def test_policy_switch_reaches_connected_sessions(serve, channels, sessions, caplog):
    d = serve()
    target = f"unix://{d.socket_path}"
    s = sessions(target, "switcher")
    assert s.registration.policy_blocks is True
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    with caplog.at_level(logging.INFO, logger="crossover.client.session"):
        admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name="passthrough"), timeout=5)
        wait_for(lambda: "switched policy to passthrough" in caplog.text)
    assert s.acquire(0) is True
    s.release(0)


def test_stopping_the_daemon_releases_waiters(serve, channels, streams, sessions):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    q, call = holding_stream(stub, streams, "hog")
    for _ in range(3):  # keep the hog alive while the waiter blocks
        q.put(pb.RankEvent(kind=pb.HEARTBEAT))
    waiter = sessions(target, "blocked", grant_timeout_s=10.0)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(waiter.acquire(0)), daemon=True)
    t.start()
    time.sleep(0.2)
    assert not result
    t0 = time.monotonic()
    d.stop(grace=0.5)
    t.join(timeout=5)
    assert result == [True]  # granted by the shutdown, not timed out
    assert time.monotonic() - t0 < 3


def test_close_delivers_every_event_still_queued(serve, sessions, tmp_path):
    """A short job's last events must reach the daemon when the session closes at exit."""
    d = serve(policy="passthrough")
    s = sessions(f"unix://{tmp_path / 'd.sock'}", "burst")
    assert s.attached
    for i in range(300):  # passthrough: acquire does not wait, so events pile up in the stream
        s.acquire(i)
        s.release(i, 0.001)
    s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        releases = [e for e in d.core.events.snapshot() if e["event"] == "release" and e["job_name"] == "burst"]
        if len(releases) == 300:
            break
        time.sleep(0.05)
    assert len(releases) == 300, f"the daemon saw {len(releases)} of 300 compute phases"


def test_turn_floor_places_a_new_job_where_the_others_are(serve, channels, streams, sessions):
    d = serve(policy="crossover")
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    reg = register(stub, job="veteran", world=1)
    _q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                       pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=40, seq=1, turn_base=2))
    assert first_directive(call).grant.seq == 1
    newcomer = sessions(target, "newcomer")
    assert newcomer.turn_floor() == 43  # the veteran holds turn 42; its next request is 43
    request = wait_for(lambda: [e for e in d.core.events.snapshot() if e["event"] == "request"])
    assert request[0]["iteration"] == 40 and request[0]["turn"] == 42
    assert rpc_error(stub.TurnFloor, pb.TurnFloorRequest(session_id="nope"), timeout=5).code() \
        == grpc.StatusCode.NOT_FOUND
    assert rpc_error(stub.TurnFloor, pb.TurnFloorRequest(), timeout=5).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_negative_turn_base_is_refused(serve, channels):
    d = serve(policy="crossover")
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="bad", world=1)
    events = [pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
              pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=1, turn_base=-5)]
    err = rpc_error(lambda: list(stub.Session(iter(events), timeout=5)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "turn_base" in err.details()


def test_a_request_sent_during_comm_carries_the_end_of_the_allreduce(serve, sessions):
    d = serve(policy="exclusive")
    s = sessions(f"unix://{d.socket_path}", "folded")
    assert s.acquire(0) is True
    s.release(0, 0.01, comm_begins=True)  # one message: COMPUTE_DONE that begins the allreduce
    assert s.acquire(1, comm_s=0.25) is True  # COMPUTE_REQUEST with the comm length (under the lease it
    s.release(1, 0.01)                        # rides on this COMPUTE_DONE: one message for both)
    kinds = ("comm_begin", "comm_end", "request")
    def folded() -> list[dict] | None:  # iteration 1 may arrive up to CROSSOVER_REPORT_INTERVAL late
        events = [e for e in d.core.events.snapshot() if e["event"] in kinds and e.get("job_name") == "folded"]
        return events[-3:] if events and events[-1]["iteration"] == 1 else None

    comm_begin, comm_end, request = wait_for(folded)
    assert comm_begin["event"] == "comm_begin" and comm_begin["iteration"] == 0
    assert comm_end["event"] == "comm_end" and comm_end["iteration"] == 0 and comm_end["duration_s"] == 0.25
    assert request["event"] == "request" and request["iteration"] == 1
    rank = next(r for r in d.core.snapshot()[1] if r.ident.job_name == "folded")
    assert rank.mean_comm_s == pytest.approx(0.25)


def test_no_socket_means_no_daemon_at_once_and_a_silent_one_gets_the_connect_timeout(sessions, tmp_path, caplog):
    t0 = time.monotonic()
    s = sessions(f"unix://{tmp_path / 'absent.sock'}", "lonely", connect_timeout_s=30.0)
    assert not s.attached and time.monotonic() - t0 < 1.0
    assert "no daemon socket at" in caplog.text

    import socket as _socket
    silent = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)  # bound and listening, never answering
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(1)
    try:
        t0 = time.monotonic()
        s = sessions(f"unix://{tmp_path / 'silent.sock'}", "patient", connect_timeout_s=0.5)
        assert not s.attached and time.monotonic() - t0 >= 0.5
    finally:
        silent.close()


def test_a_lease_is_revoked_when_a_second_rank_arrives_and_compute_never_overlaps(serve, sessions):
    """A rank computes alone under a lease while other ranks come and go on its device.

    Overlap is observed where it would happen, in the clients: each marks the
    device busy while it "computes", so a grant the daemon gave too early
    shows up as two at once, whatever the event log says. Every arrival
    revokes the lease, every departure lets the lone rank have it again.
    """
    d = serve(policy="exclusive")
    target = f"unix://{d.socket_path}"
    busy, most = [0], [0]
    lock = threading.Lock()
    stop = threading.Event()
    counts: dict[str, int] = {}

    def work(s: Session, name: str, iters: int) -> None:
        counts[name] = 0
        for i in range(iters):
            if stop.is_set():
                return
            assert s.acquire(i, comm_s=0.001 if i else None) is True
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            time.sleep(0.002)
            with lock:
                busy[0] -= 1
            s.release(i, 0.002, comm_begins=True)
            counts[name] += 1
            time.sleep(0.001)  # "allreduce"

    alpha = sessions(target, "alpha")
    ta = threading.Thread(target=work, args=(alpha, "alpha", 100_000), daemon=True)
    ta.start()
    visitors = 12
    for n in range(visitors):
        before = alpha.leased_acquires
        wait_for(lambda b=before: alpha.leased_acquires >= b + 5)  # alone again, and leased
        visitor = sessions(target, f"visitor{n}")
        work(visitor, visitor.info.job_name, 5)
        visitor.close()
    stop.set()
    ta.join(timeout=30)
    assert all(counts[f"visitor{n}"] == 5 for n in range(visitors))
    assert most[0] == 1
    kinds = [e["event"] for e in d.core.events.snapshot() if e.get("job_name") == "alpha"]
    assert kinds.count("lease") == visitors + 1
    assert kinds.count("lease_revoke") == kinds.count("lease_released") == visitors
    assert "lease_expired" not in kinds


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_rank_knows_whether_it_shares_its_device(serve, sessions, transport):
    d = serve(policy="passthrough")
    target = f"unix://{d.socket_path}"
    alone = sessions(target, "alone", transport=transport)
    wait_for(lambda: alone.attached and not alone.shares_device)
    other_device = sessions(target, "elsewhere", device=1, transport=transport)
    wait_for(lambda: other_device.attached and not other_device.shares_device)
    assert not alone.shares_device
    company = sessions(target, "company", transport=transport)
    wait_for(lambda: company.attached and alone.shares_device and company.shares_device)
    company.close()
    wait_for(lambda: not alone.shares_device)


def test_a_newcomer_is_not_granted_before_the_holder_gives_up_its_lease(serve, channels, streams, sessions):
    """The holder here is driven by hand: it computes under its lease, its request still unsent, and
    answers the revocation late. The newcomer (a real client) must wait for that answer and then
    for the holder's COMPUTE_DONE, not be granted the device that looks idle to the daemon."""
    d = serve(policy="exclusive")
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    reg = stub.Register(pb.RegisterRequest(protocol_version=1, identity=identity(job="holder", world=1),
                                           accepts_leases=True), timeout=5)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=1))
    assert first_directive(call).grant.seq == 1
    assert first_directive(call).lease.held is True
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0, comm_begins=True))
    # iteration 1 starts under the lease; nothing is sent yet
    newcomer = sessions(target, "newcomer")
    granted = threading.Event()
    threading.Thread(target=lambda: newcomer.acquire(0) and granted.set(), daemon=True).start()
    assert first_directive(call).lease.held is False
    assert not granted.wait(0.3)  # the daemon sees an idle device, but the holder has not answered
    q.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=1, seq=2, no_wait=True))
    q.put(pb.RankEvent(kind=pb.LEASE_RELEASED))
    assert not granted.wait(0.3)  # now queued behind the holder's compute phase
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=1, comm_begins=True))
    assert granted.wait(5)
    newcomer.release(0)


def test_a_rank_that_does_not_wait_reports_in_dated_batches(serve, sessions):
    d = serve(policy="passthrough")
    s = sessions(f"unix://{d.socket_path}", "batched")
    sent: list[int] = []
    put = s._put
    s._put = lambda event: (sent.append(event.kind), put(event))  # type: ignore[method-assign]
    for i in range(12):
        assert s.acquire(i, comm_s=0.004 if i else None) is True
        time.sleep(0.02)
        s.release(i, 0.02, comm_begins=True)
        time.sleep(0.004)
    grants = wait_for(lambda: [e for e in d.core.events.snapshot() if e["event"] == "grant"
                               and e.get("job_name") == "batched"][11:] and
                      [e for e in d.core.events.snapshot() if e["event"] == "grant" and e.get("job_name") == "batched"])
    assert sent.count(pb.BATCH) <= 6 and pb.COMPUTE_REQUEST not in sent  # 12 iterations, a few messages
    gaps = [b["t"] - a["t"] for a, b in zip(grants, grants[1:])]
    assert all(0.018 < g < 0.06 for g in gaps), gaps  # dated when they happened, not when they arrived
    rank = next(r for r in d.core.snapshot()[1] if r.ident.job_name == "batched")
    assert rank.iteration == 11 and rank.mean_compute_s == pytest.approx(0.02)


def test_a_batch_may_not_nest_or_open_or_date_into_the_future(serve, channels):
    d = serve()
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    for inner, words in ((pb.RankEvent(kind=pb.OPEN), "inside a BATCH"),
                         (pb.RankEvent(kind=pb.BATCH), "inside a BATCH"),
                         (pb.RankEvent(kind=pb.HEARTBEAT, ago_s=-1.0), "ago_s")):
        reg = register(stub, job=f"nest{inner.kind}{inner.ago_s}")
        events = [pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), pb.RankEvent(kind=pb.BATCH, batch=[inner])]
        err = rpc_error(lambda ev=events: list(stub.Session(iter(ev), timeout=5)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


# ---- the session socket: the Session stream as frames -------------------------------------------


def frame_client(path: str, *events: pb.RankEvent) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(path)
    for ev in events:
        c.sendall(framing.encode(ev))
    return c


def read_directive(c: socket.socket) -> pb.Directive | None:
    """The next directive but for device-share news, or None when the daemon closed the connection."""
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = c.recv(n - len(buf))
            if not chunk:
                return b""
            buf += chunk
        return buf

    while True:
        header = exact(4)
        if not header:
            return None
        d = pb.Directive()
        d.ParseFromString(exact(struct.unpack(">I", header)[0]))
        if not d.HasField("share"):
            return d


def test_sessions_use_the_session_socket_and_contend_exactly_as_over_grpc(serve, sessions):
    d = serve(policy="exclusive")
    assert d.session_socket == f"{d.socket_path}.session"
    assert stat.S_IMODE(os.stat(d.session_socket).st_mode) == 0o660
    target = f"unix://{d.socket_path}"
    fast = sessions(target, "frames")
    slow = sessions(target, "grpc-stream", transport="grpc")
    assert (fast.transport, slow.transport) == ("session socket", "grpc")
    assert fast.registration.session_socket == d.session_socket
    assert fast.acquire(0) is True
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(slow.acquire(0)), daemon=True)
    t.start()
    time.sleep(0.3)
    assert got == []  # exclusive: the gRPC rank waits for the frames rank's release
    fast.release(0, 0.3)
    t.join(5)
    assert got == [True]
    slow.release(0, 0.01)
    got.clear()
    t = threading.Thread(target=lambda: got.append(fast.acquire(1)), daemon=True)
    t.start()
    t.join(5)
    assert got == [True]
    grants = [e for e in d.core.events.snapshot() if e["event"] == "grant"]
    assert [e["job_name"] for e in grants] == ["frames", "grpc-stream", "frames"]
    d.stop(grace=0.5)
    assert not os.path.exists(d.session_socket) and not os.path.exists(d.socket_path)


def test_bad_frames_end_that_stream_with_a_clear_error_and_the_daemon_keeps_serving(serve, channels, sessions):
    d = serve()
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="bad-frames", world=1)
    cases = [
        ([framing.encode(pb.RankEvent(kind=pb.COMPUTE_REQUEST, seq=1))], "INVALID_ARGUMENT", "must be OPEN"),
        ([framing.encode(pb.RankEvent(kind=pb.OPEN, session_id="nope"))], "NOT_FOUND", "unknown session"),
        ([struct.pack(">I", framing.MAX_FRAME + 1)], "INVALID_ARGUMENT", "limit"),
        ([struct.pack(">I", 3) + b"\xff\xff\xff"], "INVALID_ARGUMENT", "RankEvent"),
        ([framing.encode(pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id)),
          framing.encode(pb.RankEvent(kind=pb.COMPUTE_DONE, duration_s=-1))], "INVALID_ARGUMENT", "duration_s"),
    ]
    for frames, code, words in cases:
        c = frame_client(d.session_socket)
        try:
            for f in frames:
                c.sendall(f)
            reply = read_directive(c)
            assert reply is not None and reply.HasField("error"), (code, words)
            assert (reply.error.code, words in reply.error.message) == (code, True), reply.error
            assert read_directive(c) is None  # and the daemon closed that connection
        finally:
            c.close()
    ok = sessions(f"unix://{d.socket_path}", "good")
    assert ok.transport == "session socket" and ok.acquire(0) is True


def test_a_rank_killed_mid_frame_or_silent_on_the_session_socket_frees_its_grant(serve, channels, sessions):
    d = serve(policy="exclusive")
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="torn", world=1)
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                     pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=1))
    assert read_directive(c).grant.seq == 1
    waiter = sessions(f"unix://{d.socket_path}", "next", grant_timeout_s=10.0)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire(0)), daemon=True)
    t.start()
    time.sleep(0.2)
    assert got == []
    c.sendall(framing.encode(pb.RankEvent(kind=pb.HEARTBEAT))[:3])  # dies inside a frame
    t0 = time.monotonic()
    c.close()
    t.join(5)
    assert got == [True] and time.monotonic() - t0 < 1.0


def test_register_over_tcp_offers_no_session_socket(serve, channels, tmp_path):
    d = serve(socket=tmp_path / "both.sock", listen="127.0.0.1:0", token="s3cret")
    tcp = pb_grpc.SchedulerStub(channels(f"127.0.0.1:{d.port}"))
    reg = tcp.Register(pb.RegisterRequest(protocol_version=1, identity=identity(job="remote")), timeout=5,
                       metadata=[(TOKEN_METADATA_KEY, "s3cret")])
    assert reg.session_socket == ""  # a path on this node means nothing to a remote peer
    local = register(pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}")), job="local")
    assert local.session_socket == d.session_socket


def test_without_a_usable_session_socket_a_rank_streams_over_grpc(serve, sessions, caplog):
    off = serve(session_socket=False)
    s = sessions(f"unix://{off.socket_path}", "no-offer")
    assert off.session_socket is None and s.registration.session_socket == "" and s.transport == "grpc"
    assert s.acquire(0) is True
    s.release(0)

    gone = serve(socket=off.socket_path.replace("d.sock", "g.sock"))
    os.unlink(gone.session_socket)  # offered but unusable (say, not mounted into the rank's container)
    with caplog.at_level(logging.INFO, logger="crossover.client.session"):
        s2 = sessions(f"unix://{gone.socket_path}", "fallback")
    assert s2.transport == "grpc" and "using the gRPC stream" in caplog.text
    assert s2.acquire(0) is True
    s2.release(0)


def test_after_a_grant_timeout_a_rank_trains_unscheduled_for_the_cool_off_instead_of_waiting_every_iteration(
        serve, channels, streams, sessions):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    q, call = holding_stream(stub, streams, "hog")  # the hog holds device 0 and never releases it
    waiter = sessions(target, "patient", grant_timeout_s=0.3, cool_off_s=1.0)
    t0 = time.monotonic()
    assert waiter.acquire(0) is False  # timed out: unscheduled
    assert time.monotonic() - t0 >= 0.3
    waiter.release(0, 0.01, comm_begins=True)
    t1 = time.monotonic()
    for it in range(1, 6):  # during the cool-off every iteration goes on at once
        assert waiter.acquire(it, comm_s=0.001) is False
        waiter.release(it, 0.001, comm_begins=True)
    assert time.monotonic() - t1 < 0.25, "a rank in its cool-off paid the grant timeout again"
    time.sleep(1.0)
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0, comm_begins=True))  # the hog lets go
    assert waiter.acquire(6, comm_s=0.001) is True  # after the cool-off it is scheduled again
    waiter.release(6)


def test_the_socket_folder_is_made_0770_and_an_unsafe_one_is_refused(tmp_path):
    old = os.umask(0o027)
    try:
        d = Daemon(make_core(), socket_path=str(tmp_path / "new" / "d.sock"), reap_interval_s=0.05).start()
        d.stop(grace=0.2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o770
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # another user could replace the socket
    with pytest.raises(FailedPrecondition, match="writable by other users"):
        Daemon(make_core(), socket_path=str(shared / "d.sock"), reap_interval_s=0.05).start()
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot replace our files
    Daemon(make_core(), socket_path=str(shared / "d.sock"), reap_interval_s=0.05).start().stop(grace=0.2)


# ---- limits: what one client may cost the daemon (issue 13 items 3, 4 and 8) -----------------------


def _session_threads() -> int:
    return sum(t.name == "session-conn" for t in threading.enumerate())


def test_a_batch_over_the_limit_is_refused_and_nothing_of_it_is_logged(serve, channels):
    d = serve(policy="passthrough")
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="flood", world=1)
    done = pb.RankEvent(kind=pb.COMPUTE_DONE, requested=True, duration_s=0.001)
    batch = pb.RankEvent(kind=pb.BATCH, batch=[done] * 8000)
    before = len(d.core.events.snapshot())
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), batch)
    err = read_directive(c)
    assert err.error.code == "INVALID_ARGUMENT" and "limit is 256" in err.error.message
    logged = [e["event"] for e in d.core.events.snapshot()[before:]]
    assert "compute" not in logged and "done" not in logged and len(logged) <= 3, logged
    c.close()


def test_a_session_sending_faster_than_the_limit_is_closed_with_resource_exhausted(serve, channels, sessions):
    d = serve(policy="exclusive", limits=StreamLimits(events_per_s=50))
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="chatty", world=1)
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id))
    with contextlib.suppress(BrokenPipeError):  # the daemon may close it before the last frames
        c.sendall(framing.encode(pb.RankEvent(kind=pb.HEARTBEAT)) * 300)
    codes = []
    while (msg := read_directive(c)) is not None:
        if msg.HasField("error"):
            codes.append(msg.error.code)
    assert codes == ["RESOURCE_EXHAUSTED"]
    wait_for(lambda: not any(r.ident.job_name == "chatty" for r in d.core.snapshot()[1]))
    rank = sessions(f"unix://{d.socket_path}", "polite")  # a rank within the limit is served as before
    assert rank.acquire(0) is True
    rank.release(0)


def test_connections_are_capped_counted_and_their_threads_end(serve, channels, sessions):
    d = serve(policy="exclusive", limits=StreamLimits(max_connections=2))
    admin = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    baseline = _session_threads()
    first, second = frame_client(d.session_socket), frame_client(d.session_socket)
    third = frame_client(d.session_socket)
    refusal = read_directive(third)
    assert refusal.error.code == "RESOURCE_EXHAUSTED" and "--max-connections" in refusal.error.message
    state = admin.GetQueue(pb.QueueRequest(protocol_version=1, device=-1))
    assert (state.connections, state.max_connections) == (2, 2)
    for c in (first, second, third):
        c.close()
    wait_for(lambda: admin.GetQueue(pb.QueueRequest(protocol_version=1, device=-1)).connections == 0)
    wait_for(lambda: _session_threads() == baseline)
    rank = sessions(f"unix://{d.socket_path}", "after")
    assert rank.acquire(0) is True
    rank.release(0)


def test_a_connection_that_never_opens_or_falls_silent_is_closed(serve, channels):
    d = serve(policy="exclusive", limits=StreamLimits(open_timeout_s=0.3, idle_timeout_s=0.6),
              heartbeat_timeout_s=5.0, evict_after_s=30.0)
    baseline = _session_threads()
    mute = frame_client(d.session_socket)
    t0 = time.monotonic()
    assert read_directive(mute).error.message == "no OPEN in time"
    assert read_directive(mute) is None and time.monotonic() - t0 < 3.0
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="quiet", world=1)
    quiet = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id))
    t0 = time.monotonic()
    while (msg := read_directive(quiet)) is not None and not msg.HasField("error"):
        pass
    assert msg is not None and msg.error.message == "no event in time" and time.monotonic() - t0 < 3.0
    wait_for(lambda: _session_threads() == baseline)
    mute.close()
    quiet.close()


def test_errors_do_not_echo_unbounded_client_input(serve, channels):
    d = serve(policy="exclusive")
    channel = channels(f"unix://{d.admin_socket}")
    huge = "x" * 100_000
    err = rpc_error(pb_grpc.AdminStub(channel).SetPolicy, pb.PolicyRequest(protocol_version=1, name=huge))
    assert err.code() == grpc.StatusCode.NOT_FOUND or err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.details()) < 400, len(err.details())
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=huge))
    refusal = read_directive(c)
    assert refusal.error.code == "NOT_FOUND" and len(refusal.error.message) < 400
    c.close()
