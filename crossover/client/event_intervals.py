"""Phases from crossoverd event logs: who computed, communicated and waited on which device, and when.

Pure functions over the event dicts the daemon writes with `--event-log` (see `daemon/event_log.py`),
so `crossover timeline` and `crossover stats` share one reading of the log and it is tested directly.

Events are paired per rank, in the order of their `t`: the daemon dates some events back (a rank
reports a phase late), so the order of the lines is not the order of the phases.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = [
    "DeviceKey", "DeviceStats", "Interval", "JobStats", "PhaseKind", "PhaseLog", "Stats", "UnknownJob",
    "clip", "compute_stats", "covered_length", "job_labels", "merge_logs", "operator_marks", "policy_changes",
    "read_phases", "select_jobs", "union_length", "window",
]

_log = logging.getLogger(__name__)

PhaseKind = Literal["compute", "comm", "wait", "overdue", "suspended"]
DeviceKey = tuple[str, int]  # (node, device index)

_HOLDS: frozenset[str] = frozenset({"compute", "overdue"})  # the rank's compute runs on the device


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


@dataclass(frozen=True)
class JobStats:
    """One job over a window; lengths in seconds, means per interval, each interval clipped to the window.

    `iterations`: compute phases that ended (released, not yielded) inside the window, of the rank that
    ended most (a job's ranks step together). Totals are summed over the job's ranks.
    `compute_share`: compute time over the ranks' active time in the window (each rank from the
    start of its first phase to the end of its last).
    `iteration_s`: the busiest rank's active time over its iterations; `alone_s`: what an iteration
    would take with nobody to wait for, its mean compute plus mean comm phase as the daemon saw them
    (an estimate: sharing can also stretch the phases themselves); `slowdown`: their ratio.
    """

    job_id: str
    job_name: str
    ranks: tuple[int, ...]
    iterations: int
    compute_total_s: float
    compute_mean_s: float
    comm_total_s: float
    comm_mean_s: float
    wait_total_s: float
    wait_mean_s: float
    wait_p95_s: float
    wait_max_s: float
    compute_share: float
    iteration_s: float = 0.0
    alone_s: float = 0.0
    slowdown: float = 0.0


@dataclass(frozen=True)
class DeviceStats:
    """One device over a window: `busy_fraction` is the time at least one rank computed on it (overlapping
    holders counted once) over the window's length; `grants` counts grants inside the window; `holders`
    names each rank that computed on it, as `job/rank`."""

    node: str
    device: int
    busy_fraction: float
    grants: int
    holders: tuple[str, ...]


@dataclass(frozen=True)
class Stats:
    """`sharing_gain`: the jobs' speeds added up, each as a fraction of its own alone estimate (two
    jobs at 0.6 each: 1.2, i.e. 1.2x what running them one after another would have done)."""

    since: float
    until: float
    jobs: tuple[JobStats, ...]
    devices: tuple[DeviceStats, ...]
    sharing_gain: float = 0.0


class UnknownJob(ValueError):
    """A job asked for by name or id that the log does not contain."""


def merge_logs(logs: Iterable[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One event list from several daemons' logs, each event's `t` in seconds since the earliest event.

    Each log's `t` is its own daemon's monotonic clock, which means nothing on another node; each log
    is shifted onto the wall clock by its median `wall - t` (robust to a clock step), keeping the
    monotonic spacing inside a log. Entries without a numeric `t` or an `event` are dropped.
    """
    shifted: list[dict[str, Any]] = []
    for log in logs:
        events = [dict(e) for e in log if _is_event(e)]
        walls = [e["wall"] - e["t"] for e in events
                 if isinstance(e.get("wall"), (int, float)) and math.isfinite(e["wall"])]
        offset = statistics.median(walls) if walls else 0.0
        for e in events:
            e["t"] = e["t"] + offset
        shifted.extend(events)
    if shifted:
        origin = min(e["t"] for e in shifted)
        for e in shifted:
            e["t"] -= origin
    return shifted


def _is_event(e: Any) -> bool:
    return (isinstance(e, Mapping) and isinstance(e.get("event"), str) and isinstance(e.get("t"), (int, float))
            and not isinstance(e.get("t"), bool) and e["t"] == e["t"])


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


def read_phases(events: Iterable[Mapping[str, Any]]) -> PhaseLog:
    """Pair the events of each rank (node, job, rank), in `t` order, into phases.

    An end without its beginning (the log was rotated or cut there) is kept only when it says how long
    the phase was: a `comm_end` by its `duration_s`, a grant's wait by its `waited_s`; a release without
    a grant is ignored. A phase still open at the end of its node's log ends there, incomplete.
    """
    evs = [e for e in events if _is_event(e)]
    jobs: dict[str, str] = {}
    per_rank: dict[tuple[str, str, int], list[Mapping[str, Any]]] = defaultdict(list)
    node_last: dict[str, float] = {}
    for e in evs:
        node = str(e.get("node", ""))
        node_last[node] = max(node_last.get(node, e["t"]), e["t"])
        if "rank" not in e or "job" not in e:
            continue  # policy, drain, resume of a device: not about a rank
        job = str(e["job"])
        jobs.setdefault(job, str(e.get("job_name") or job))
        per_rank[(node, job, _int(e["rank"]))].append(e)
    out: list[Interval] = []
    for (node, job, rank), rank_events in per_rank.items():
        state = _Rank(node, job, jobs[job], rank, out)
        for e in sorted(rank_events, key=lambda e: e["t"]):
            _replay(state, e)
        state.end_all(node_last[node])
    out.sort(key=lambda iv: (iv.start, iv.end))
    first = min((e["t"] for e in evs), default=0.0)
    last = max((e["t"] for e in evs), default=0.0)
    return PhaseLog(tuple(out), jobs, first, last)


def _replay(r: _Rank, e: Mapping[str, Any]) -> None:
    ev, t, device = e["event"], float(e["t"]), _int(e.get("device", -1))
    if ev == "request":
        r.begin("wait", t, device)
    elif ev == "grant":
        r.end_measured("wait", t, device, _float(e.get("waited_s")))
        r.begin("compute", t, device)
    elif ev == "release":
        if not r.end("compute", t, complete="held_s" in e and not e.get("yields")):
            _log.debug("release without a grant ignored: %s", dict(e))
    elif ev == "overdue":
        r.end("compute", t, complete=False)
        r.begin("overdue", t, device)
    elif ev == "overdue_done":
        r.end("overdue", t, complete=True)
    elif ev == "cancel":
        r.end("wait", t, complete=False)
    elif ev == "suspend":  # silent past the heartbeat timeout: nothing it does is known until it speaks
        for phase in ("wait", "comm", "compute"):
            r.end(phase, t, complete=False)
        r.begin("suspended", t, device)
    elif ev == "resume":
        r.end("suspended", t, complete=True)
    elif ev == "comm_begin":
        r.begin("comm", t, device)
    elif ev == "comm_end":
        r.end_measured("comm", t, device, _float(e.get("duration_s")))
    elif ev == "leave":
        r.end_all(t)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _float(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0
    return x if x == x else 0.0


def select_jobs(log: PhaseLog, wanted: Iterable[str]) -> frozenset[str]:
    """The ids of the jobs named in `wanted`, each by its name, its id or the start of its id (as
    `crossover jobs` shows it); every job when `wanted` is empty. `UnknownJob` names one that matches none."""
    wanted = list(wanted)
    if not wanted:
        return frozenset(log.jobs)
    chosen: set[str] = set()
    for w in wanted:
        hits = {j for j, name in log.jobs.items() if w in (name, j) or (len(w) >= 6 and j.startswith(w))}
        if not hits:
            names = ", ".join(sorted(set(log.jobs.values()))) or "none"
            raise UnknownJob(f"no job {w!r} in the log (jobs: {names})")
        chosen |= hits
    return frozenset(chosen)


def window(log: PhaseLog, since: float | None = None, until: float | None = None) -> tuple[float, float]:
    """[since, until] in the log's seconds, each given relative to the first event, or before the last
    one when negative; None is that end of the log. The result may be empty (since >= until)."""

    def at(x: float | None, default: float) -> float:
        if x is None:
            return default
        return log.last + x if x < 0 else log.first + x

    return at(since, log.first), at(until, log.last)


def clip(intervals: Iterable[Interval], since: float, until: float) -> list[Interval]:
    """The intervals that overlap [since, until], cut to it; an interval whose end is cut is no longer complete."""
    out = []
    for iv in intervals:
        inside = (iv.end > since and iv.start < until) if iv.end > iv.start else since <= iv.start <= until
        if not inside:
            continue
        if iv.start >= since and iv.end <= until:
            out.append(iv)
        else:
            out.append(replace(iv, start=max(iv.start, since), end=min(iv.end, until),
                               complete=iv.complete and iv.end <= until))
    return out


def union_length(intervals: Iterable[Interval]) -> float:
    """How long at least one of the intervals covers (overlaps counted once)."""
    return covered_length((iv.start, iv.end) for iv in intervals)


def covered_length(spans: Iterable[tuple[float, float]]) -> float:
    """How long at least one (start, end) span covers (overlaps counted once)."""
    total, cur_a, cur_b = 0.0, 0.0, None
    for a, b in sorted(spans):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def compute_stats(log: PhaseLog, since: float, until: float, jobs: Iterable[str] | None = None) -> Stats:
    """Per job and per device over [since, until], from the phases of `jobs` (ids; None: every job).

    Devices are those the chosen jobs used anywhere in the log, so one idle in the window shows 0.
    """
    chosen = frozenset(log.jobs) if jobs is None else frozenset(jobs)
    mine = [iv for iv in log.intervals if iv.job in chosen]
    inside = clip(mine, since, until)
    length = until - since
    labels = job_labels({j: log.jobs[j] for j in chosen})

    job_rows = []
    for job in (j for j in log.jobs if j in chosen):
        ivs = [iv for iv in inside if iv.job == job]
        if not ivs:
            continue
        comp = [iv.length for iv in ivs if iv.phase == "compute"]
        comm = [iv.length for iv in ivs if iv.phase == "comm"]
        wait = [iv.length for iv in ivs if iv.phase == "wait"]
        spans: dict[int, tuple[float, float]] = {}
        for iv in ivs:
            a, b = spans.get(iv.rank, (iv.start, iv.end))
            spans[iv.rank] = (min(a, iv.start), max(b, iv.end))
        active = sum(b - a for a, b in spans.values())
        done = Counter(iv.rank for iv in ivs if iv.phase == "compute" and iv.complete)
        busiest = max(done, key=lambda r: (done[r], -r), default=None)
        iteration = (spans[busiest][1] - spans[busiest][0]) / done[busiest] if busiest is not None else 0.0
        alone = _mean(comp) + _mean(comm)
        job_rows.append(JobStats(
            job_id=job, job_name=log.jobs[job], ranks=tuple(sorted({iv.rank for iv in ivs})),
            iterations=max(Counter(iv.rank for iv in ivs if iv.phase == "compute" and iv.complete).values(),
                           default=0),
            compute_total_s=sum(comp), compute_mean_s=_mean(comp), comm_total_s=sum(comm), comm_mean_s=_mean(comm),
            wait_total_s=sum(wait), wait_mean_s=_mean(wait), wait_p95_s=_percentile(wait, 95),
            wait_max_s=max(wait, default=0.0), compute_share=sum(comp) / active if active > 0 else 0.0,
            iteration_s=iteration, alone_s=alone, slowdown=iteration / alone if alone > 0 else 0.0))

    dev_rows = []
    for key in sorted({iv.device_key for iv in mine}):
        holding = [iv for iv in inside if iv.device_key == key and iv.phase in _HOLDS]
        grants = sum(1 for iv in mine if iv.device_key == key and iv.phase == "compute" and since <= iv.start < until)
        holders = sorted({(labels[iv.job], iv.rank) for iv in holding})
        dev_rows.append(DeviceStats(node=key[0], device=key[1],
                                    busy_fraction=union_length(holding) / length if length > 0 else 0.0,
                                    grants=grants, holders=tuple(f"{name}/{rank}" for name, rank in holders)))
    gain = sum(1.0 / j.slowdown for j in job_rows if j.slowdown > 0)
    return Stats(since, until, tuple(job_rows), tuple(dev_rows), sharing_gain=gain)


def operator_marks(events: Iterable[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """(t, text) of each drain, resume and eviction of a device or job, in time order, with its node."""
    out = []
    for e in events:
        if not _is_event(e) or "rank" in e or e["event"] not in ("drain", "resume", "evict"):
            continue
        what = f"job {e['job']}"[:20] if e["event"] == "evict" and e.get("job") else f"dev{_int(e.get('device'))}"
        out.append((float(e["t"]), f"{e['event']} {what} @{e.get('node', '?')}"))
    return sorted(out)


def policy_changes(events: Iterable[Mapping[str, Any]], within_s: float = 1.0) -> list[tuple[float, str]]:
    """(t, new policy) of each `policy` event, in time order; the same switch logged by several nodes
    within `within_s` of each other is one."""
    out: list[tuple[float, str]] = []
    for e in sorted((e for e in events if _is_event(e) and e["event"] == "policy"), key=lambda e: e["t"]):
        new = str(e.get("new", "?"))
        if not any(name == new and e["t"] - t <= within_s for t, name in out[-8:]):
            out.append((e["t"], new))
    return out


def job_labels(jobs: Mapping[str, str]) -> dict[str, str]:
    """A short label per job id: its name, with the start of its id where two jobs share a name."""
    counts: dict[str, int] = defaultdict(int)
    for name in jobs.values():
        counts[name] += 1
    return {j: name if counts[name] == 1 else f"{name} ({j[:8]})" for j, name in jobs.items()}
