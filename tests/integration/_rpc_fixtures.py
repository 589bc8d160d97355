"""Shared fixtures and helpers of the tests split out of `tests/integration/test_rpc.py`."""
from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crossover.client.session import RankInfo, Session
from crossover.client.settings import PluginSettings
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.limits import StreamLimits
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.server import Daemon
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos import framing

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
