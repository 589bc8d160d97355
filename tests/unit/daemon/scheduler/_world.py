"""The scheduler tests' world: fakes for the clock and `pid_alive`, rank identities, sessions and outboxes.

The fixtures built on them (`clock`, `pids`, `make`) are in this folder's `conftest.py`."""
from __future__ import annotations

import itertools
import queue
from typing import Any

from crossover.daemon.api import Phase
from crossover.daemon.events import EventKind, RankEvent
from crossover.daemon.messages import AliveMsg, GrantMsg, LeaseMsg, ShareMsg
from crossover.daemon.scheduler import Scheduler
from crossover.protos.identity import RankIdentity

# pids above Linux's largest pid_max (2**22): psutil never finds such a process.
_PID = 10_000_000


_pids = itertools.count(_PID)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakePids:
    """`pid_alive` that says yes unless a pid was marked dead."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    def __call__(self, pid: int) -> bool:
        return pid not in self.dead


def ident(job: str = "job-a", rank: int = 0, world: int = 2, device: int = 0, local_rank: int | None = None,
          local_size: int | None = None, pid: int | None = None, name: str | None = None) -> RankIdentity:
    return RankIdentity(job_id=job, job_name=name or f"name-{job}", rank=rank,
                    local_rank=rank if local_rank is None else local_rank, world_size=world,
                    local_size=world if local_size is None else local_size, node="ignored", device=device,
                    pid=next(_pids) if pid is None else pid)


def drain_outbox(box: queue.SimpleQueue, shares: bool = False) -> list:
    """The messages queued for a session; `ShareMsg`s only when asked for, heartbeat answers
    (`AliveMsg`) never (most tests are about the rest)."""
    out = []
    while True:
        try:
            msg = box.get_nowait()
        except queue.Empty:
            return out
        if isinstance(msg, AliveMsg) or (isinstance(msg, ShareMsg) and not shares):
            continue
        out.append(msg)


def event(s: Scheduler, sid: str, kind: str, iteration: int = 0, seq: int = 0, duration_s: float = 0.0,
          **flags: Any) -> None:
    """Apply one rank event, given by its kind's name as the event log spells it (`compute_request`,
    `compute_done`, `comm_begin`, `comm_end`, `heartbeat`, `lease_released`), as its stream would."""
    s.apply(sid, RankEvent(EventKind(kind), iteration, seq, duration_s, **flags))


def join(s: Scheduler, leases: bool = True, **kw) -> tuple[str, queue.SimpleQueue]:
    reg = s.register(ident(**kw), accepts_leases=leases)
    return reg.session_id, s.attach(reg.session_id)


def _phase(s: Scheduler, sid: str) -> Phase:
    return s._state.sessions[sid].phase  # noqa: SLF001 (test introspection)


def _events_of(s: Scheduler, rank: int, job: str = "job-a") -> list[str]:
    return [e.name for e in s.events.events() if e.job == job and e.rank == rank]


def holders_over_time(s: Scheduler, device: int = 0) -> int:
    """The most ranks the event log ever shows holding ``device`` at once."""
    held: set = set()
    most = 0
    for e in s.events.events():
        if e.device != device:
            continue
        if e.name == "grant":
            held.add((e.job, e.rank))
        elif e.name in ("release", "leave"):
            held.discard((e.job, e.rank))
        most = max(most, len(held))
    return most


def leased(s: Scheduler) -> tuple[str, queue.SimpleQueue]:
    a, box = join(s, job="old", world=1, rank=0, device=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    event(s, a, "compute_done", iteration=0, comm_begins=True)
    assert drain_outbox(box) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    return a, box


_KINDS = ("compute_request", "compute_request_no_wait", "compute_done", "compute_done_requested", "comm_begin",
          "comm_end", "lease_released", "heartbeat")
