"""The one reading of an event log's phases: who computed, communicated and waited on which device, and when.

Events are paired per rank, in the order of their `t`: the daemon dates some events back (a rank
reports a phase late), so the order of the lines is not the order of the phases. `crossover timeline`
and `stats`, the test beds' oracles and the benchmarks' judges all take their intervals from here.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, Union

from crossover.protos.event_file import Event, EventName, typed
from crossover.protos.event_records import CommEnd, Drain, Evict, Grant, Policy, Record, Release, Resume

__all__ = ["HOLDS", "DeviceKey", "Interval", "PhaseKind", "PhaseLog", "merge_logs", "operator_marks", "policy_changes",
           "read_phases"]

_log = logging.getLogger(__name__)

PhaseKind = Literal["compute", "comm", "wait", "overdue", "suspended"]
DeviceKey = tuple[str, int]  # (node, device index)

_OPERATOR_MARKS: dict[EventName | str, type[Drain | Resume | Evict]] = {
    EventName.DRAIN: Drain, EventName.RESUME: Resume, EventName.EVICT: Evict}  # without a rank: about a device

Events = Iterable[Union[Event, Mapping[str, Any]]]
"""What the readers here take: `Event`s, or the objects of a log's lines (an in-memory log's entries)."""

HOLDS: frozenset[str] = frozenset({"compute", "overdue"})
"""The phases in which a rank's compute runs on its device."""


@dataclass(frozen=True)
class Interval:
    """One phase of one rank, `start` to `end` in the log's seconds.

    `phase`: compute (grant to release: the rank holds the device), comm (its allreduce), wait
    (request to grant) or overdue (the daemon treated the holder as stalled and served the next rank,
    but it went on computing until `overdue_done`).
    `complete`: the phase ended by its own closing event (a compute phase by its release, not a yield;
    an allreduce by `comm_end`; a wait by its grant), not cut by an overdue, a suspension, the rank
    leaving, the end of the log or a window.
    """

    phase: PhaseKind
    node: str
    device: int
    job: str
    job_name: str
    rank: int
    start: float
    end: float
    complete: bool

    @property
    def length(self) -> float:
        return self.end - self.start

    @property
    def device_key(self) -> DeviceKey:
        return (self.node, self.device)


@dataclass(frozen=True)
class PhaseLog:
    """Every phase found in a log, with the jobs it names and the span of its events."""

    intervals: tuple[Interval, ...]
    jobs: Mapping[str, str]  # job id -> job name, in order of first appearance
    first: float  # `t` of the first and the last event
    last: float


def merge_logs(logs: Iterable[Events]) -> list[Event]:
    """One event list from several daemons' logs, each event's `t` in seconds since the earliest event.

    Each log's `t` is its own daemon's monotonic clock, which means nothing on another node; each log
    is shifted onto the wall clock by its median `wall - t` (robust to a clock step), keeping the
    monotonic spacing inside a log. Entries that are no event (no name, no numeric `t`) are dropped.
    """
    shifted: list[Event] = []
    for log in logs:
        events = typed(log)
        walls = [e.wall - e.t for e in events if e.wall and math.isfinite(e.wall)]
        offset = statistics.median(walls) if walls else 0.0
        shifted.extend(replace(e, t=e.t + offset) for e in events)
    origin = min((e.t for e in shifted), default=0.0)
    return [replace(e, t=e.t - origin) for e in shifted]


class _Rank:
    """The phases of one rank still open while its events are replayed."""

    def __init__(self, node: str, job: str, job_name: str, rank: int, out: list[Interval]) -> None:
        self.ident = (node, job, job_name, rank)
        self.open: dict[PhaseKind, tuple[float, int]] = {}
        self.out = out

    def begin(self, phase: PhaseKind, t: float, device: int) -> None:
        self.end(phase, t, complete=False)
        self.open[phase] = (t, device)

    def end(self, phase: PhaseKind, t: float, complete: bool) -> bool:
        began = self.open.pop(phase, None)
        if began is None:
            return False
        self.add(phase, began[0], t, began[1], complete)
        return True

    def add(self, phase: PhaseKind, start: float, end: float, device: int, complete: bool) -> None:
        node, job, job_name, rank = self.ident
        self.out.append(Interval(phase, node, device, job, job_name, rank, start, max(start, end), complete))

    def end_measured(self, phase: PhaseKind, t: float, device: int, length: float) -> None:
        """End `phase` at `t`; had it no beginning (a cut log), it still ran `length` seconds up to `t`."""
        if not self.end(phase, t, complete=True) and length > 0:
            self.add(phase, t - length, t, device, True)

    def end_all(self, t: float) -> None:
        for phase in list(self.open):
            self.end(phase, t, complete=False)


def read_phases(events: Events) -> PhaseLog:
    """Pair the events of each rank (node, job, rank), in `t` order, into phases.

    An end without its beginning (the log was rotated or cut there) is kept only when it says how long
    the phase was: a `comm_end` by its `duration_s`, a grant's wait by its `waited_s`; a release without
    a grant is ignored. A phase still open at the end of its node's log ends there, incomplete.
    """
    evs = typed(events)
    jobs: dict[str, str] = {}
    per_rank: dict[tuple[str, str, int], list[Event]] = defaultdict(list)
    node_last: dict[str, float] = {}
    for e in evs:
        node = "" if e.node is None else str(e.node)
        node_last[node] = max(node_last.get(node, e.t), e.t)
        if not e.about_rank:
            continue  # policy, drain, resume of a device: not about a rank
        job = str(e.job)
        jobs.setdefault(job, str(e.job_name or job))
        per_rank[(node, job, _int(e.rank))].append(e)
    out: list[Interval] = []
    for (node, job, rank), rank_events in per_rank.items():
        state = _Rank(node, job, jobs[job], rank, out)
        for e in sorted(rank_events, key=lambda e: e.t):
            _replay(state, e)
        state.end_all(node_last[node])
    out.sort(key=lambda iv: (iv.start, iv.end))
    first = min((e.t for e in evs), default=0.0)
    last = max((e.t for e in evs), default=0.0)
    return PhaseLog(tuple(out), jobs, first, last)


def _replay(r: _Rank, e: Event) -> None:
    ev, t, device = e.name, e.t, _int(e.device)
    if ev == EventName.REQUEST:
        r.begin("wait", t, device)
    elif ev == EventName.GRANT:
        grant = _read(e, Grant)
        r.end_measured("wait", t, device, _seconds(grant.waited_s if grant is not None else None))
        r.begin("compute", t, device)
    elif ev == EventName.RELEASE:
        release = _read(e, Release)
        if not r.end("compute", t, complete=release is not None and release.held_s is not None
                     and not release.yields):
            _log.debug("release without a grant ignored: %s", e)
    elif ev == EventName.OVERDUE:
        r.end("compute", t, complete=False)
        r.begin("overdue", t, device)
    elif ev == EventName.OVERDUE_DONE:
        r.end("overdue", t, complete=True)
    elif ev == EventName.CANCEL:
        r.end("wait", t, complete=False)
    elif ev == EventName.SUSPEND:  # silent past the heartbeat timeout: nothing it does is known until it speaks
        for phase in ("wait", "comm", "compute"):
            r.end(phase, t, complete=False)
        r.begin("suspended", t, device)
    elif ev == EventName.RESUME:
        r.end("suspended", t, complete=True)
    elif ev == EventName.COMM_BEGIN:
        r.begin("comm", t, device)
    elif ev == EventName.COMM_END:
        comm = _read(e, CommEnd)
        r.end_measured("comm", t, device, _seconds(comm.duration_s if comm is not None else None))
    elif ev == EventName.LEAVE:
        r.end_all(t)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


_R = TypeVar("_R", bound=Record)


def _read(e: Event, kind: type[_R]) -> _R | None:
    """The event's record; None for a line that lacks a field or holds a value of another type (a damaged or
    hand-made log): the phase boundary it marks still counts, its figures do not."""
    try:
        record = kind.of(e)
    except ValueError as exc:
        _log.debug("%s", exc)
        return None
    return record


def _seconds(value: float | None) -> float:
    """A phase's length as the log gives it; 0 (none given) for a missing or NaN one."""
    return value if value is not None and value == value else 0.0




def operator_marks(events: Events) -> list[tuple[float, str]]:
    """(t, text) of each drain, resume and eviction of a device or job, in time order, with its node and
    the caller the event names, where it names them."""
    out = []
    for e in typed(events):
        kind = _OPERATOR_MARKS.get(e.name)
        mark = _read(e, kind) if kind is not None and e.rank is None else None
        if mark is None:
            continue
        what = f"job {mark.job}"[:20] if isinstance(mark, Evict) and mark.job else f"dev{_int(mark.device)}"
        node, caller = e.node, mark.caller
        out.append((e.t, f"{e.name} {what}" + (f" @{node}" if node else "") + (f" by {caller}" if caller else "")))
    return sorted(out)


def policy_changes(events: Events, within_s: float = 1.0) -> list[tuple[float, str]]:
    """(t, new policy) of each `policy` event, in time order; the same switch logged by several nodes
    within `within_s` of each other is one."""
    out: list[tuple[float, str]] = []
    for e in sorted((e for e in typed(events) if e.name == EventName.POLICY), key=lambda e: e.t):
        policy = _read(e, Policy)
        new = policy.new if policy is not None else "?"
        if not any(name == new and e.t - t <= within_s for t, name in out[-8:]):
            out.append((e.t, new))
    return out
