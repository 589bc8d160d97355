"""The entry points: `simulate` (any jobs, any policy) and `simulate_small` (the emulated cluster's scenario)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

from .metrics import SimResult, summarize
from .spec import LINK_SHARING, POLICIES, SMALL_POLICIES, JobSpec, PolicyFactory, SimConfig
from .world import World


def simulate(jobs: Sequence[JobSpec], policy: Union[str, PolicyFactory], *, n_nodes: int, devices_per_node: int = 1,
             config: SimConfig | None = None) -> SimResult:
    """Run `jobs` on `n_nodes` x `devices_per_node` under `policy` (a name in `POLICIES` or a factory).

    Each node gets its own policy instance. Runs until every job has left (or
    `config.horizon_s`); a job without `iterations` or `leave_s` needs a horizon.
    """
    cfg = config or SimConfig()
    if cfg.link_sharing not in LINK_SHARING:
        raise ValueError(f"unknown link_sharing {cfg.link_sharing!r}; choose one of: {', '.join(LINK_SHARING)}")
    if cfg.skew_s < 0:
        raise ValueError(f"skew_s {cfg.skew_s}: must be >= 0")
    if isinstance(policy, str):
        try:
            factory = POLICIES[policy]
        except KeyError:
            raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}") from None
    else:
        factory = policy
    if cfg.horizon_s is None and any(j.iterations is None and j.leave_s is None for j in jobs):
        raise ValueError("a job without iterations or leave_s runs forever: set SimConfig.horizon_s")
    world = World(jobs, factory, n_nodes, devices_per_node, cfg)
    world.run()
    return summarize(world)


def simulate_small(compute_s: float, comm_s: float, n_jobs: int, policy: str, *, n_nodes: int = 2,
                   iterations: int = 200, jitter: float = 0.05, switch_penalty: float = 0.05,
                   tick_s: float | None = 0.1, startup_spread_s: float = 0.5, grant_latency_s: float = 0.0003,
                   seed: int = 0, link_sharing: str = "fair", interference: float = 0.0,
                   comm_interference: float | None = None) -> dict[str, Any]:
    """The emulated-cluster scenario: `n_nodes` x 1 device, `n_jobs` identical jobs with one rank per node.

    `policy` is one of `SMALL_POLICIES`: a name in `POLICIES` (jobs co-located),
    `alone` (one job by itself) or `sequential` (the jobs one after another).
    Defaults mirror the testbed: the daemon ticks every 0.1 s (its reaper), a
    grant round trip costs ~0.3 ms, co-located processes on one core lose ~5%
    to switching. Returns plain numbers, to compare with the measured table:
    `throughput_iter_s` (all jobs), `per_job_iter_s`, `slowdown`, `bound_iter_s`,
    `bound_fraction`, `device_busy`, `fairness`.
    """
    if policy not in SMALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(SMALL_POLICIES)}")
    cfg = SimConfig(seed=seed, switch_penalty=switch_penalty, tick_s=tick_s, startup_spread_s=startup_spread_s,
                    grant_latency_s=grant_latency_s, link_sharing=link_sharing, interference=interference,
                    comm_interference=comm_interference)
    place = tuple((n, 0) for n in range(n_nodes))
    specs = [JobSpec(f"job{i}", place, compute_s, comm_s, iterations=iterations, jitter=jitter) for i in range(n_jobs)]
    bound = 1.0 / max(n_jobs * compute_s, n_jobs * comm_s, compute_s + comm_s)
    if policy in ("alone", "sequential"):
        res = simulate(specs[:1], "exclusive", n_nodes=n_nodes, config=cfg)
        rate = res.jobs[0].iter_per_s or 0.0
        # Sequential: at any time one job runs at its alone speed, so the cluster does
        # `rate` iterations/s in all and each job's completion is n_jobs times later.
        per_job = [rate] if policy == "alone" else [rate / n_jobs] * n_jobs
        throughput = rate
        busy = res.device_busy
    else:
        res = simulate(specs, policy, n_nodes=n_nodes, config=cfg)
        per_job = [j.iter_per_s or 0.0 for j in res.jobs]
        throughput = res.throughput_iter_s
        busy = res.device_busy
    alone = res.jobs[0].alone_iter_s
    slowdown = [1.0 / (r * alone) if r else math.inf for r in per_job]
    return {
        "policy": policy, "n_jobs": n_jobs, "n_nodes": n_nodes, "compute_s": compute_s, "comm_s": comm_s,
        "throughput_iter_s": throughput, "per_job_iter_s": per_job, "slowdown": slowdown,
        "bound_iter_s": n_jobs * bound, "bound_fraction": throughput / (n_jobs * bound),
        "device_busy": busy, "fairness": max(per_job) / min(per_job) if min(per_job) > 0 else math.inf,
        "alone_iter_s": alone,
    }
