"""The gRPC edge against a real in-process daemon: the session socket (the Session stream as frames) and
the limits on what one client may cost the daemon."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time

import grpc
import pytest

from crossover.daemon.api import FailedPrecondition
from crossover.daemon.limits import StreamLimits
from crossover.daemon.server import Daemon, Endpoints
from crossover.protos import PROTOCOL_VERSION as VERSION
from crossover.protos import TOKEN_METADATA_KEY, framing
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.event_records import Request
from tests.integration.rpc._world import holding_stream, identity, make_core, register, rpc_error, wait_for

pytestmark = pytest.mark.timeout(60)


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


def _session_threads() -> int:
    return sum(t.name == "session-conn" for t in threading.enumerate())


# ---- the session socket: the Session stream as frames -------------------------------------------


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
    grants = [e for e in d.core.events.events() if e.name == "grant"]
    assert [e.job_name for e in grants] == ["frames", "grpc-stream", "frames"]
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
    reg = tcp.Register(pb.RegisterRequest(protocol_version=VERSION, identity=identity(job="remote")), timeout=5,
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
    with caplog.at_level(logging.INFO, logger="crossover.client"):
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
    for it in range(1, 6):  # during the cool-off every iteration goes on at once, asking for nothing
        assert waiter.acquire(it, comm_s=0.001) is False
        waiter.release(it, 0.001, comm_begins=True)
    asked = [Request.of(e).iteration for e in d.core.events.events()
             if e.name is Request.name and e.job_name == "patient"]
    assert asked == [0], f"a rank in its cool-off asked for the device again: {asked}"
    time.sleep(1.0)
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0, comm_begins=True))  # the hog lets go
    assert waiter.acquire(6, comm_s=0.001) is True  # after the cool-off it is scheduled again
    waiter.release(6)


def test_the_socket_folder_is_made_0750_and_an_unsafe_one_is_refused(tmp_path):
    old = os.umask(0o027)
    try:
        d = Daemon(make_core(), Endpoints(socket_path=str(tmp_path / "new" / "d.sock")), reap_interval_s=0.05).start()
        d.stop(grace=0.2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o750
    ours = tmp_path / "ours"
    ours.mkdir()
    os.chmod(ours, 0o770)  # as an older daemon left it: its group could replace the sockets
    Daemon(make_core(), Endpoints(socket_path=str(ours / "d.sock")), reap_interval_s=0.05).start().stop(grace=0.2)
    assert stat.S_IMODE(os.stat(ours).st_mode) == 0o750
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)  # another user's folder
    with pytest.raises(FailedPrecondition, match="belongs to uid 65534"):
        Daemon(make_core(), Endpoints(socket_path=str(shared / "d.sock")), reap_interval_s=0.05).start()
    os.chown(shared, 0, 0)
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot replace our files
    Daemon(make_core(), Endpoints(socket_path=str(shared / "d.sock")), reap_interval_s=0.05).start().stop(grace=0.2)


# ---- limits: what one client may cost the daemon (issue 13 items 3, 4 and 8) -----------------------


def test_a_batch_over_the_limit_is_refused_and_nothing_of_it_is_logged(serve, channels):
    d = serve(policy="passthrough")
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    reg = register(stub, job="flood", world=1)
    done = pb.RankEvent(kind=pb.COMPUTE_DONE, requested=True, duration_s=0.001)
    batch = pb.RankEvent(kind=pb.BATCH, batch=[done] * 8000)
    before = len(d.core.events.events())
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), batch)
    err = read_directive(c)
    assert err.error.code == "INVALID_ARGUMENT" and "limit is 256" in err.error.message
    logged = [e.name for e in d.core.events.events()[before:]]
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
    wait_for(lambda: not any(r.ident.job_name == "chatty" for r in d.core.steering.snapshot()[1]))
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
    state = admin.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1))
    assert (state.connections, state.max_connections) == (2, 2)
    for c in (first, second, third):
        c.close()
    wait_for(lambda: admin.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1)).connections == 0)
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
    err = rpc_error(pb_grpc.AdminStub(channel).SetPolicy, pb.PolicyRequest(protocol_version=VERSION, name=huge))
    assert err.code() == grpc.StatusCode.NOT_FOUND or err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.details()) < 400, len(err.details())
    c = frame_client(d.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=huge))
    refusal = read_directive(c)
    assert refusal.error.code == "NOT_FOUND" and len(refusal.error.message) < 400
    c.close()
