"""What the simulator is asked to run: jobs, the world around the policies, and the policies by name."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from crossover.daemon import policies
from crossover.daemon.api import CrossoverError, Policy

from .link import LinkPolicy
from .turns import TurnsPolicy, TurnsSettings

LINK_SHARING = ("fair", "fifo")


class SimulationError(CrossoverError):
    """The simulated world and a policy disagree (e.g. a grant for a rank that is not waiting)."""


# ---- policies -----------------------------------------------------------------------------------

PolicyFactory = Callable[[], Policy]

_TABLE_ORDER = ("passthrough", "exclusive", "turns-nosync", "turns", "crossover", "crossover-link")


def _registry() -> dict[str, PolicyFactory]:
    """The daemon's policies (`policies.create`), the retired `turns` and `turns` without synchronization,
    and `crossover-link` (kept out of the daemon), in table order."""
    factories: dict[str, PolicyFactory] = {name: functools.partial(policies.create, name)
                                           for name in policies.available()}
    factories["turns"] = TurnsPolicy
    factories["turns-nosync"] = functools.partial(TurnsPolicy, TurnsSettings(tiebreak="join_order"))
    factories["crossover-link"] = LinkPolicy
    rank = {name: i for i, name in enumerate(_TABLE_ORDER)}
    return {name: factories[name] for name in sorted(factories, key=lambda n: (rank.get(n, len(rank)), n))}


POLICIES: dict[str, PolicyFactory] = _registry()
"""Policies the simulator compares, by name; `simulate` also takes any factory."""

SMALL_POLICIES = ("alone", "sequential", *POLICIES)
"""What `simulate_small` accepts: the emulated-cluster benchmark's variants."""


# ---- jobs and the world -------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """One job: where its ranks run, how long its phases take, when it comes and goes.

    `placement[r]` is rank r's (node, device). `compute_s` is the mean compute
    phase, one value for all ranks or one per rank (heterogeneous workers).
    The job leaves after `iterations` iterations, at `leave_s` (a crash or a
    kill), or when the simulation ends, whichever is first.
    """

    name: str
    placement: tuple[tuple[int, int], ...]
    compute_s: float | tuple[float, ...]
    comm_s: float
    iterations: int | None = None
    arrival_s: float = 0.0
    leave_s: float | None = None
    jitter: float = 0.0  # sigma of the lognormal factor (mean 1) on each compute and allreduce
    priority: str = "normal"  # its class on every node (high, normal, low): `policies.classes`
    weight: float = 1.0  # its weight within the class

    def rank_compute_s(self, rank: int) -> float:
        return self.compute_s if isinstance(self.compute_s, (int, float)) else self.compute_s[rank]

    def validate(self, n_nodes: int, devices_per_node: int) -> None:
        if not self.placement:
            raise ValueError(f"job {self.name!r} has no ranks")
        for node, dev in self.placement:
            if not (0 <= node < n_nodes and 0 <= dev < devices_per_node):
                raise ValueError(f"job {self.name!r} places a rank on ({node}, {dev}), outside "
                                 f"{n_nodes} nodes x {devices_per_node} devices")
        if not isinstance(self.compute_s, (int, float)) and len(self.compute_s) != len(self.placement):
            raise ValueError(f"job {self.name!r}: {len(self.compute_s)} compute times for "
                             f"{len(self.placement)} ranks")
        if min(self.rank_compute_s(r) for r in range(len(self.placement))) <= 0 or self.comm_s < 0:
            raise ValueError(f"job {self.name!r}: compute times must be > 0 and comm_s >= 0")
        if self.iterations is not None and self.iterations < 1:
            raise ValueError(f"job {self.name!r}: iterations must be >= 1")


@dataclass(frozen=True)
class SimConfig:
    """The world around the policies. Defaults: an ideal world (no penalty, exact deadlines)."""

    seed: int = 0
    switch_penalty: float = 0.0  # k>1 concurrent computes each run at 1/(k*(1+penalty))
    shared_links: bool = True  # concurrent allreduces through one (node, device) link share it
    link_sharing: str = "fair"  # how they share it: "fair" (equal rates) or "fifo" (in the order they began)
    tick_s: float | None = None  # None: tick at the policy's deadlines; else every tick_s (daemon reaper)
    startup_spread_s: float = 0.0  # ranks of a job join within this window after its arrival
    grant_latency_s: float = 0.0  # grant round trip, added to each blocking compute phase
    skew_s: float = 0.0  # each rank's node learns its allreduce ended up to this much later (uniform draw)
    interference: float = 0.0  # a compute phase and an allreduce on one (node, device) each run at 1/(1+this)
    comm_interference: float | None = None  # the allreduce's own slowdown there, if not `interference`
    horizon_s: float | None = None  # stop here (jobs still running count what they did)
    warmup_iterations: int = 3  # excluded from per-job rates
    record_trace: bool = False  # keep every compute span (node, device, job, start, end)
    check_exclusive: bool = True  # fail if a blocking policy lets two ranks compute on one device
    yield_s: float | None = None  # a rank the policy asks to yield hands its device back this long after (the
    # message, the rest of a layer), and asks again for the rest of its phase; None: never (work in one piece)
