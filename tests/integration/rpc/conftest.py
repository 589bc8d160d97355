"""The gRPC edge tests' fixtures: in-process daemons, channels, raw Session streams and real clients, each
stopped or closed at teardown so a failing assertion leaves no server thread or socket behind."""
from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crossover.client.rank.session import Session
from crossover.daemon.limits import StreamLimits
from crossover.daemon.server import Daemon, Endpoints
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings
from tests.integration.rpc._world import _END, make_core


@pytest.fixture
def serve(tmp_path):
    """`serve(**scheduler_kw)` → a started Daemon on a temp socket; stopped at teardown."""
    daemons: list[Daemon] = []

    def start(socket: Path | None = None, listen: str | None = None, token: str | None = None,
              session_socket: bool = True, limits: StreamLimits | None = None, admin_token: str | None = None,
              **core_kw) -> Daemon:
        sock = None if listen and socket is None else str(socket or tmp_path / "d.sock")
        endpoints = Endpoints(socket_path=sock, listen=listen, token=token, session_socket=session_socket,
                              admin_token=admin_token)
        d = Daemon(make_core(**core_kw), endpoints, limits or StreamLimits(), reap_interval_s=0.05)
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
    """Real `crossover.client.rank.session.Session` clients, closed at teardown; other keywords are `PluginSettings`."""
    made: list[Session] = []

    def make(target: str, job: str, rank: int = 0, world: int = 1, **kw) -> Session:
        settings = PluginSettings(target=target, token=kw.pop("token", ""), job_name=job, device=kw.pop("device", 0),
                                  grant_timeout_s=kw.pop("grant_timeout_s", 5.0),
                                  connect_timeout_s=kw.pop("connect_timeout_s", 2.0), reconnect_interval_s=30.0,
                                  pin=False, transport=kw.pop("transport", "auto"),
                                  cool_off_s=kw.pop("cool_off_s", 10.0), **kw)
        info = RankIdentity(job_id=f"id-{job}", job_name=job, rank=rank, local_rank=rank, world_size=world,
                            local_size=world, device=settings.device)
        s = Session(info, settings)
        made.append(s)
        return s.start()

    yield make
    for s in made:
        s.close()
