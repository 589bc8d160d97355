"""An offline reference for small instances: the best fixed cyclic order of jobs on every device.

The pipeline bound (`metrics._bounds`) asks every device to be busy all the
time, which jobs that span different node sets cannot all have at once: a job
computes only when all of its devices serve it, and its partners differ from
node to node. A tighter, reachable reference is the best *schedule* for the
instance. This module searches one family of schedules exhaustively: every
device serves its jobs in a fixed cycle, one compute phase per job per round
(round-robin), in an order chosen per device. Each combination of orders runs
in the simulator under `FixedOrderPolicy`, which waits for the job whose
place in the cycle it is, and the fastest is the reference. It is known
before the run (the search sees the whole instance); an online policy sees
only its own node. Schedules outside the family (a short job served twice per
round) can beat it in iterations per second, which is why the table reports
the share of the reference, not a claim that the reference is optimal.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies._queues import DispatchPolicy, _Device

from .run import simulate
from .spec import JobSpec, SimConfig, SimulationError

__all__ = ["FixedOrderPolicy", "Reference", "best_cyclic_orders"]

Orders = dict[tuple[int, int], tuple[str, ...]]  # (node, device) -> job names in serve order


class FixedOrderPolicy(DispatchPolicy):
    """Serves each device's jobs strictly in a given cycle of job names, waiting for the next one.

    A job that has left is skipped. Pure; one instance per node (`node` picks its cycles).
    """

    name = "fixed-order"
    blocks = True

    def __init__(self, orders: Orders, node: int) -> None:
        super().__init__()
        self._cycle = {dev: list(names) for (n, dev), names in orders.items() if n == node}
        self._next = {dev: 0 for dev in self._cycle}
        self._names: dict[str, str] = {}  # job id -> name

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._names[rank.key.job_id] = rank.job_name
        return super().join(rank, now)

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        device = self._q.ranks[key].device if key in self._q.ranks else None
        name = self._names.get(key.job_id)
        if device is not None and name in self._cycle.get(device, []) and not any(
                k.job_id == key.job_id and r.device == device for k, r in self._q.ranks.items() if k != key):
            self._skip(device, name)
        return super().leave(key, now)

    def _skip(self, device: int, name: str) -> None:
        cycle = self._cycle[device]
        i = cycle.index(name)
        cycle.pop(i)
        if cycle:
            if i < self._next[device]:
                self._next[device] -= 1
            self._next[device] %= len(cycle)
        else:
            self._next[device] = 0

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        device = dev.index
        cycle = self._cycle.get(device)
        if dev.holders or not dev.waiting or not cycle:
            return []
        due = cycle[self._next[device]]
        key = next((k for k in dev.waiting if self._names[k.job_id] == due), None)
        if key is None:
            return []
        self._next[device] = (self._next[device] + 1) % len(cycle)
        self._q.grant(dev, key)
        return [key]


@dataclass(frozen=True)
class Reference:
    orders: Orders
    throughput_iter_s: float  # sum over jobs of iterations/s under the best orders
    searched: int  # combinations of orders simulated
    deadlocked: int  # combinations whose cycles wait on each other for ever


def _factory(orders: Orders):
    nodes = itertools.count()
    return lambda: FixedOrderPolicy(orders, next(nodes))


def best_cyclic_orders(jobs: Sequence[JobSpec], *, n_nodes: int, devices_per_node: int = 1,
                       config: SimConfig | None = None, max_combinations: int = 5000) -> Reference:
    """Simulate every combination of per-device serve orders; return the fastest (sum of iterations/s).

    Raises `ValueError` when the instance has more than `max_combinations` (the
    search is exhaustive: the product over devices of (jobs on it)!).
    """
    cfg = config or SimConfig()
    on: dict[tuple[int, int], list[str]] = {}
    for spec in jobs:
        for place in dict.fromkeys(spec.placement):
            on.setdefault(place, []).append(spec.name)
    places = sorted(on)
    total = math.prod(math.factorial(len(on[p])) for p in places)
    if total > max_combinations:
        raise ValueError(f"{total} combinations of orders: more than max_combinations={max_combinations}")
    best: Reference | None = None
    deadlocked = 0
    for combo in itertools.product(*(itertools.permutations(on[p]) for p in places)):
        orders = dict(zip(places, combo))
        try:
            res = run_orders(jobs, orders, n_nodes=n_nodes, devices_per_node=devices_per_node, config=cfg)
        except SimulationError:
            deadlocked += 1
            continue
        if res.stalled_jobs:
            deadlocked += 1
            continue
        if best is None or res.throughput_iter_s > best.throughput_iter_s:
            best = Reference(orders, res.throughput_iter_s, 0, 0)
    if best is None:
        raise ValueError("every combination of orders deadlocks")
    return replace(best, searched=total, deadlocked=deadlocked)


def run_orders(jobs: Sequence[JobSpec], orders: Orders, *, n_nodes: int, devices_per_node: int = 1,
               config: SimConfig | None = None):
    """The instance under fixed `orders` (e.g. a `Reference`'s), as a `SimResult`."""
    return simulate(jobs, _factory(orders), n_nodes=n_nodes, devices_per_node=devices_per_node, config=config)
