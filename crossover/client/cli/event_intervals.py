"""What `crossover stats` and `timeline` compute from an event log's phases: per job and device, over a window.

Pure functions over the intervals `crossover.protos.event_phases` reads from the log (that module is the
one reading of its events), so both commands share one figure of each thing and it is tested directly.
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from crossover.errors import CrossoverError
from crossover.figures import percentile
from crossover.protos.event_phases import (
    HOLDS,
    DeviceKey,
    Interval,
    PhaseKind,
    PhaseLog,
    merge_logs,
    operator_marks,
    policy_changes,
    read_phases,
)

__all__ = [
    "DeviceKey", "DeviceStats", "Interval", "JobStats", "PhaseKind", "PhaseLog", "Stats", "UnknownJob",
    "clip", "compute_stats", "covered_length", "job_labels", "merge_logs", "operator_marks", "policy_changes",
    "read_phases", "select_jobs", "union_length", "window",
]

_log = logging.getLogger(__name__)


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
    """`sharing_gain`: the jobs' speeds added up, each as a fraction of its own alone estimate and weighted
    by the share of the window the job was there (two jobs at 0.6 each for the whole window: 1.2, i.e. 1.2x
    what running them one after another would have done; two that ran one after the other at full speed: 1)."""

    since: float
    until: float
    jobs: tuple[JobStats, ...]
    devices: tuple[DeviceStats, ...]
    sharing_gain: float = 0.0


class UnknownJob(CrossoverError, ValueError):
    """A job asked for by name or id that the log does not contain."""


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
    present: dict[str, float] = {}  # job -> the share of the window its busiest rank was there
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
        if busiest is not None and length > 0:
            present[job] = (spans[busiest][1] - spans[busiest][0]) / length
        job_rows.append(JobStats(
            job_id=job, job_name=log.jobs[job], ranks=tuple(sorted({iv.rank for iv in ivs})),
            iterations=max(Counter(iv.rank for iv in ivs if iv.phase == "compute" and iv.complete).values(),
                           default=0),
            compute_total_s=sum(comp), compute_mean_s=_mean(comp), comm_total_s=sum(comm), comm_mean_s=_mean(comm),
            wait_total_s=sum(wait), wait_mean_s=_mean(wait), wait_p95_s=percentile(wait, 95) if wait else 0.0,
            wait_max_s=max(wait, default=0.0), compute_share=sum(comp) / active if active > 0 else 0.0,
            iteration_s=iteration, alone_s=alone, slowdown=iteration / alone if alone > 0 else 0.0))

    dev_rows = []
    for key in sorted({iv.device_key for iv in mine}):
        holding = [iv for iv in inside if iv.device_key == key and iv.phase in HOLDS]
        grants = sum(1 for iv in mine if iv.device_key == key and iv.phase == "compute" and since <= iv.start < until)
        holders = sorted({(labels[iv.job], iv.rank) for iv in holding})
        dev_rows.append(DeviceStats(node=key[0], device=key[1],
                                    busy_fraction=union_length(holding) / length if length > 0 else 0.0,
                                    grants=grants, holders=tuple(f"{name}/{rank}" for name, rank in holders)))
    gain = sum(present.get(j.job_id, 0.0) / j.slowdown for j in job_rows if j.slowdown > 0)
    return Stats(since, until, tuple(job_rows), tuple(dev_rows), sharing_gain=gain)


def job_labels(jobs: Mapping[str, str]) -> dict[str, str]:
    """A short label per job id: its name, with the start of its id where two jobs share a name."""
    counts: dict[str, int] = defaultdict(int)
    for name in jobs.values():
        counts[name] += 1
    return {j: name if counts[name] == 1 else f"{name} ({j[:8]})" for j, name in jobs.items()}
