"""What a simulation measured: per-job rates and waits, cluster throughput against its bound, device use."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .spec import JobSpec
from .state import ComputeSpan

if TYPE_CHECKING:
    from .world import World


@dataclass
class JobResult:
    name: str
    job_id: str
    ranks: int
    iterations: int
    iter_per_s: float | None  # over the job's own iterations after warm-up
    alone_iter_s: float  # one iteration with the devices and links to itself
    slowdown: float | None  # (1 / iter_per_s) / alone_iter_s
    bound_iter_per_s: float | None  # 1 / max(C + M, max over its devices of max(sum C, sum M)); static only
    grant_wait_mean_s: float
    grant_wait_max_s: float
    finished: bool
    left_at: float | None


@dataclass
class SimResult:
    policy: str
    jobs: list[JobResult]
    makespan_s: float
    throughput_iter_s: float  # sum over jobs of iter_per_s
    normalized_throughput: float  # sum over jobs of alone_iter_s * iter_per_s ("jobs at full speed")
    bound_iter_s: float | None  # sum of the jobs' bounds (static scenarios only)
    bound_fraction: float | None
    device_busy: float  # mean over devices of time with >= 1 compute / time with >= 1 rank present
    idle_waiting: float  # same, of time the device idled while ranks waited for it (held for a turn)
    fairness: float | None  # max / min over jobs of normalized progress (1 = perfectly fair)
    slowdown_mean: float | None
    slowdown_max: float | None
    completed_iterations: int
    stalled_jobs: list[str]  # jobs still waiting when nothing else could happen (a deadlock)
    events: int
    policy_calls: int
    trace: list[ComputeSpan] = field(default_factory=list)

    def to_dict(self, per_job: bool = True) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("jobs", "trace")}
        if per_job:
            d["jobs"] = [j.__dict__.copy() for j in self.jobs]
        return d


def alone_iteration_s(spec: JobSpec, seed: int = 0, samples: int = 2000) -> float:
    """Mean iteration time of the job with every device and link to itself.

    An iteration is its slowest rank's compute plus the allreduce; with jitter or
    heterogeneous ranks that is more than mean(C) + M, so it is estimated by
    sampling (exact when there is no jitter).
    """
    means = np.array([spec.rank_compute_s(r) for r in range(len(spec.placement))])
    if spec.jitter <= 0:
        return float(means.max()) + spec.comm_s
    s = spec.jitter
    draws = np.random.default_rng(seed).lognormal(-0.5 * s * s, s, size=(samples, len(means)))
    return float((draws * means).max(axis=1).mean()) + spec.comm_s


def _static(jobs: Sequence[JobSpec]) -> bool:
    return all(j.arrival_s == 0 and j.leave_s is None for j in jobs) and len({j.iterations for j in jobs}) == 1


def _bounds(jobs: Sequence[JobSpec], shared_links: bool) -> list[float]:
    """Per job: 1 / max(C + M, over its devices max(sum of compute means, sum of comm times)).

    For identical jobs this is the pipeline bound 1/max(sum C, sum M): a device
    (and its link) serves every job on it once per cycle at best. Means only,
    no jitter. For jobs that differ it is the bound of round-robin service (one
    iteration per job per cycle), which a policy favouring short jobs can beat.
    """
    c_sum: dict[tuple[int, int], float] = {}
    m_sum: dict[tuple[int, int], float] = {}
    for spec in jobs:
        for r, place in enumerate(spec.placement):
            c_sum[place] = c_sum.get(place, 0.0) + spec.rank_compute_s(r)
        for place in set(spec.placement):
            m_sum[place] = m_sum.get(place, 0.0) + spec.comm_s
    out = []
    for spec in jobs:
        cycle = max(max(c_sum[p], m_sum[p] if shared_links else 0.0) for p in spec.placement)
        alone = max(spec.rank_compute_s(r) for r in range(len(spec.placement))) + spec.comm_s
        out.append(1.0 / max(alone, cycle))
    return out


def summarize(world: World) -> SimResult:
    """The result of a finished run: per-job rates, the cluster's throughput and its devices' use."""
    cfg = world.cfg
    specs = [j.spec for j in world.jobs]
    alone = [alone_iteration_s(s, cfg.seed) for s in specs]
    static = _static(specs)
    bounds = _bounds(specs, cfg.shared_links) if static else [None] * len(specs)
    w = cfg.warmup_iterations
    out: list[JobResult] = []
    for job, a, b in zip(world.jobs, alone, bounds):
        ends = job.iter_ends
        rate = None
        if len(ends) > w + 1 or (w == 0 and ends and job.started_at is not None):
            t0 = ends[w - 1] if w > 0 else job.started_at
            assert t0 is not None
            span = ends[-1] - t0
            rate = (len(ends) - w) / span if span > 0 else None
        waits = job.waits
        out.append(JobResult(
            name=job.spec.name, job_id=job.id, ranks=len(job.ranks), iterations=len(ends), iter_per_s=rate,
            alone_iter_s=a, slowdown=(1.0 / rate) / a if rate else None, bound_iter_per_s=b,
            grant_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
            grant_wait_max_s=max(waits, default=0.0), finished=job.finished, left_at=job.left_at))
    rated = [j for j in out if j.iter_per_s]
    throughput = sum(j.iter_per_s or 0.0 for j in rated)
    progress = [j.alone_iter_s * (j.iter_per_s or 0.0) for j in rated]
    slowdowns = [j.slowdown for j in rated if j.slowdown]
    bound = sum(b for b in bounds if b is not None) if static and rated else None
    busy, idle = [], []
    for node in world.nodes:
        for dev in node.devices:
            if dev.computing:
                dev.busy_total += world.now - dev.busy_since
                dev.busy_since = world.now
            if dev.hungry:
                dev.hungry_total += world.now - dev.hungry_since
                dev.hungry_since = world.now
            if dev.present:
                dev.present_total += world.now - dev.present_since
                dev.present_since = world.now
            if dev.present_total > 0:
                busy.append(dev.busy_total / dev.present_total)
                idle.append(dev.hungry_total / dev.present_total)
    return SimResult(
        policy=world.policy_name, jobs=out, makespan_s=world.now, throughput_iter_s=throughput,
        normalized_throughput=sum(progress), bound_iter_s=bound,
        bound_fraction=throughput / bound if bound else None,
        device_busy=sum(busy) / len(busy) if busy else 0.0, idle_waiting=sum(idle) / len(idle) if idle else 0.0,
        fairness=max(progress) / min(progress) if progress and min(progress) > 0 else None,
        slowdown_mean=sum(slowdowns) / len(slowdowns) if slowdowns else None,
        slowdown_max=max(slowdowns, default=None), completed_iterations=sum(j.iterations for j in out),
        stalled_jobs=world.stalled, events=world.events, policy_calls=world.calls, trace=world.trace)

