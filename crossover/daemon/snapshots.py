"""What the admin calls show of the scheduler: ranks and devices at one instant."""
from __future__ import annotations

import pwd
from dataclasses import dataclass, replace
from typing import NamedTuple

import psutil

from crossover.daemon.api import Phase
from crossover.daemon.registry import Session
from crossover.protos.identity import RankIdentity

__all__ = ["DeviceSnapshot", "RankSnapshot", "rank_snapshot", "with_process_usage"]


@dataclass(frozen=True)
class RankSnapshot:
    ident: RankIdentity
    phase: Phase
    iteration: int
    mean_compute_s: float
    mean_comm_s: float
    wait_fraction: float
    since_s: float
    registered_s: float
    cpu_percent: float
    rss_bytes: int
    user: str = ""  # the kernel's uid of its session socket peer, as a name; "" when not known
    priority: str = "normal"  # its job's class on this node
    weight: float = 1.0
    class_by: str = ""  # what set the class: "operator", a --class-rule, "rank", or "" (the default)
    handover: str = ""  # "device": it ends its turns on its device; "": its CPU waits for the device
    device: int = 0
    memory_cap: int | None = None  # what it may hold on its device (None: no cap)
    memory_note: str = ""  # its last out-of-memory at its cap


class DeviceSnapshot(NamedTuple):
    holders: list[RankSnapshot]
    waiting: list[RankSnapshot]
    others: list[RankSnapshot]
    order: tuple[str, ...]


def rank_snapshot(s: Session, now: float) -> RankSnapshot:
    """The session's figures at `now`, without its process's usage (`with_process_usage` adds it)."""
    st = s.stats
    alive = max(now - s.registered_at, 1e-9)
    waiting_now = now - s.requested_at if s.phase is Phase.WAITING else 0.0
    return RankSnapshot(
        ident=s.ident,
        phase=s.phase,
        iteration=s.iteration,
        mean_compute_s=st.compute_total / st.compute_n if st.compute_n else 0.0,
        mean_comm_s=st.comm_total / st.comm_n if st.comm_n else 0.0,
        wait_fraction=min(1.0, (st.waited_total + waiting_now) / alive),
        since_s=now - s.phase_since,
        registered_s=alive,
        cpu_percent=-1.0,
        rss_bytes=0,
        user="" if s.uid is None else _user_name(s.uid),
        handover=s.handover,
        device=s.ref.device,
        memory_cap=s.memory_cap.limit,
        memory_note=s.memory_note,
    )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def with_process_usage(snap: RankSnapshot, process: psutil.Process) -> RankSnapshot:
    """The snapshot with its process's CPU and memory use; unchanged if the process cannot be read.
    Reads /proc: call it outside the scheduler's lock."""
    try:
        with process.oneshot():
            cpu, rss = process.cpu_percent(None), process.memory_info().rss
    except psutil.Error:
        return snap
    return replace(snap, cpu_percent=cpu, rss_bytes=rss)
