"""Several nodes, one policy instance each, fed the events of jobs that run in lockstep (with per-node skew)."""
from __future__ import annotations

import heapq
import random
from typing import Callable

from crossover.daemon.api import Policy, RankKey, RankRef
from testbed.simulator.turns import TurnsPolicy, TurnsSettings

S = TurnsSettings()


def lockstep(n_nodes: int, jobs: list[tuple[str, float, float]], join_at: dict[tuple[str, int], float],
              jitter: float, rounds: int, seed: int, start_at: float = 0.0, tick_s: float = 0.001,
              policy_settings: TurnsSettings = S, make: Callable[[], Policy] | None = None
              ) -> list[list[tuple[str, int]]]:
    """Run one policy per node (`make()`, else `TurnsPolicy(policy_settings)`); each job has one rank per
    node (global rank = node) on device 0.

    A job's ranks first request together once all have joined (not before
    `start_at`), then when its previous allreduce ended, each node
    seeing the event up to `jitter` later; the allreduce starts when the job's
    last rank released and takes the job's comm time. Returns, per node, the
    sequence of (job, iteration) granted.
    """
    rng = random.Random(seed)
    pols = [make() if make else TurnsPolicy(policy_settings) for _ in range(n_nodes)]
    spec = {j: (c, m) for j, c, m in jobs}
    heap: list[tuple[float, int, str, str, int]] = []
    seq = 0

    def push(t: float, kind: str, job: str, node: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, job, node))

    for (j, n), t in join_at.items():
        push(t, "join", j, n)
    for n in range(n_nodes):
        push(0.0, "tick", "", n)
    joined = {j: 0 for j, _, _ in jobs}
    released = {j: 0 for j, _, _ in jobs}
    done = {j: 0 for j, _, _ in jobs}
    began: dict[tuple[str, int], float] = {}
    order: list[list[str]] = [[] for _ in range(n_nodes)]
    busy = [False] * n_nodes

    def granted(node: int, keys: list[RankKey], now: float) -> None:
        for k in keys:
            assert not busy[node], f"node {node}: second grant while busy"
            busy[node] = True
            order[node].append((k.job_id, done[k.job_id]))
            push(now + spec[k.job_id][0] + rng.uniform(0, jitter), "release", k.job_id, node)

    base: dict[str, int] = {}

    def request_all(job: str, now: float) -> None:
        if job not in base:  # the plugin's agreement before the first request: the largest floor
            floors = [getattr(pols[n], "turn_floor", None) for n in range(n_nodes)]
            base[job] = max((f(0, job) for f in floors if f), default=0)
        for n in range(n_nodes):
            push(now + rng.uniform(0, jitter), "request", job, n)

    while heap:
        now, _, kind, job, node = heapq.heappop(heap)
        p = pols[node]
        if kind == "tick":
            granted(node, p.tick(now), now)
            if any(done[j] < rounds for j in done):
                push(now + tick_s, "tick", "", node)
        elif kind == "join":
            granted(node, p.join(RankRef(RankKey(job, node), job, 0, n_nodes, now), now), now)
            joined[job] += 1
            if joined[job] == n_nodes:
                request_all(job, max(now, start_at))
        elif kind == "request":
            granted(node, p.request(RankKey(job, node), base[job] + done[job], now), now)
        elif kind == "release":
            busy[node] = False
            p.observe(RankKey(job, node), "compute", spec[job][0], now)
            began[job, node] = now
            granted(node, p.release(RankKey(job, node), now), now)
            released[job] += 1
            if released[job] == n_nodes:
                released[job] = 0
                push(now + spec[job][1], "comm_end", job, -1)
        elif kind == "comm_end":
            done[job] += 1
            for n in range(n_nodes):
                pols[n].observe(RankKey(job, n), "comm", now - began[job, n], now)
            if done[job] < rounds:
                request_all(job, now)
            else:  # a finished job's ranks exit: each daemon sees its stream end
                for n in range(n_nodes):
                    push(now + rng.uniform(0, jitter), "leave", job, n)
        elif kind == "leave":
            granted(node, p.leave(RankKey(job, node), now), now)
    return order


def inversions(a: list, b: list) -> int:
    """Pairs of (job, iteration) grants that two nodes served in opposite order."""
    pos = {x: i for i, x in enumerate(b)}
    common = [x for x in a if x in pos]
    return sum(pos[common[i]] > pos[common[j]] for i in range(len(common)) for j in range(i + 1, len(common)))


def assert_skewed_nodes_never_drift(make: Callable[[], Policy], n_nodes: int, phases: list[tuple[float, float]],
                                    seed: int, swaps_per_round: int, rounds: int = 8) -> None:
    """Jobs of the given (compute, comm) phases join 10 ms apart and run `rounds` rounds, each node seeing
    their events up to 1 ms apart: every node serves the same grants, and differs from node 0 by at most
    `swaps_per_round` swapped pairs per round (no node runs ahead)."""
    jobs = [(f"job{i}", c, m) for i, (c, m) in enumerate(phases)]
    join_at = {(j, n): 0.01 * i for i, (j, _, _) in enumerate(jobs) for n in range(n_nodes)}
    order = lockstep(n_nodes, jobs, join_at, 0.001, rounds=rounds, seed=seed, start_at=0.1, make=make)
    assert len(order[0]) == rounds * len(jobs)
    for n in range(1, n_nodes):
        assert sorted(order[n]) == sorted(order[0])
        assert inversions(order[0], order[n]) <= swaps_per_round * rounds
