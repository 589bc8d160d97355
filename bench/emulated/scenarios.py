"""What the emulated-cluster benchmark measures (`bench/emulated/`): its scenarios and the modes each
scenario is measured in, with the daemon policy that stands for each mode."""
from __future__ import annotations

from dataclasses import dataclass

from crossover.daemon.policies.isolation import IsolationSettings

__all__ = ["ADAPTS", "ALL", "CHURN", "CLASSES", "COLOCATED", "CPU_HANDOVER", "DSCP", "FULL", "MODEL", "MODES",
           "OPEN_LOOP", "POLICY", "QUICK", "Scenario", "settle_s"]

MODES = ("sequential", "unscheduled", "exclusive", "crossover", "crossover-cpu", "adaptive", "classes",
         "classes-dscp", "classes-adaptive")
COLOCATED = MODES[1:4]
"""The co-located modes every run measures; `adaptive` and `crossover-cpu` only when asked (`bench.emulated
--adaptive`, `--handover`)."""
POLICY = {"sequential": "passthrough", "unscheduled": "passthrough", "exclusive": "exclusive", "crossover": "crossover",
          "crossover-cpu": "crossover", "adaptive": "crossover", "classes": "crossover", "classes-dscp": "crossover",
          "classes-adaptive": "crossover"}
"""`classes`: `crossover` with every job but the first in class `low` (`bench.gpu --priority`); `classes-dscp`:
the same, with every shaped link sending the low jobs' packets (DSCP `CROSSOVER_LOW_DSCP`) after the others'
(`Cluster.honour_dscp`); `classes-adaptive`: `classes` with the daemons measuring whether grants pay the
production job (`crossoverd --adapt`, the default), so each device keeps grants only where they do."""
CPU_HANDOVER = frozenset({"crossover-cpu"})
"""`crossover-cpu`: `crossover` with every rank waiting for its device on its CPU before it releases
(`crossover policy --no-handover`); the other modes let ranks that can end their turns on their device."""
CLASSES = frozenset({"classes", "classes-open", "classes-dscp", "classes-adaptive"})
"""Modes with every job but the first in class `low`."""
OPEN_LOOP = frozenset({"classes-open"})
"""Modes whose daemons run the class rules without the isolation controller (`crossover policy --protect 0`);
the others hold the production job at the daemon's default target."""
DSCP = frozenset({"classes-dscp"})
"""Modes in which the emulated network honours the low class's DSCP."""
ADAPTS = frozenset({"adaptive", "classes-adaptive"})
"""Modes whose daemons measure per device whether grants pay (`crossoverd --adapt`, the default); the others
grant everywhere."""


def settle_s(mode: str, settle: float, adapt_window_s: float) -> float:
    """How long a bed waits after switching to `mode` before it measures: `settle`; in an adaptive mode the
    first verdict's probe too (4 windows, from the next even one: 6 windows at most); where the isolation
    controller runs, its first solo window (from the next window's start: two windows at most), which a
    switch starts afresh and which would otherwise count as the production job's time alone."""
    controlled = mode in CLASSES and mode not in OPEN_LOOP
    return (settle + (6 * adapt_window_s if mode in ADAPTS else 0.0)
            + (2 * IsolationSettings().window_s if controlled else 0.0))


@dataclass(frozen=True)
class Scenario:
    """A set of jobs co-located at one comm:compute ratio (of the first job).

    `batch_scale[k]` multiplies job k's batch (its compute phase); empty: identical jobs.
    `placement[k]` names the nodes job k runs on (one rank each); empty: every job on every node.
    `visitor`: churn; one more job like job 0 arrives and leaves inside every measured segment.
    """

    name: str
    ratio: float  # target comm:compute
    jobs: int
    batch_scale: tuple[float, ...] = ()
    nodes: int = 2
    placement: tuple[tuple[int, ...], ...] = ()
    visitor: bool = False

    def __post_init__(self) -> None:
        if self.placement and (len(self.placement) != self.jobs
                               or any(not 0 <= n < self.nodes for p in self.placement for n in p)):
            raise ValueError(f"{self.name}: placement {self.placement} must name nodes 0..{self.nodes - 1} "
                             f"for each of {self.jobs} jobs")

    def nodes_of(self, k: int) -> tuple[int, ...] | None:
        """The nodes job k runs on; None: all of them."""
        return self.placement[k] if self.placement else None

    def batch(self, k: int, base: int) -> int:
        scale = self.batch_scale[k] if self.batch_scale else 1.0
        return max(16, int(round(base * scale / 16)) * 16)


FULL = (Scenario("1:1 x2", 1.0, 2), Scenario("1:2 x2", 0.5, 2), Scenario("2:1 x2", 2.0, 2),
        Scenario("1:1 x3", 1.0, 3), Scenario("mixed x3", 1.0, 3, (1.0, 0.4, 1.6)),
        Scenario("span x2", 1.0, 2, nodes=3, placement=((0, 1), (1, 2))))
# Only when named (--scenarios): on a machine whose cores are all devices, the visitors' interpreter
# start-up lands on the device cores and the figures measure that (docs/emulated-cluster.md).
CHURN = Scenario("churn x2+1", 1.0, 2, visitor=True)
# Four nodes, three jobs on each: 12 ranks, which only the device model leaves the cores for.
WIDE = Scenario("1:1 x3 4n", 1.0, 3, nodes=4)
# Four unequal jobs on one link, only when named: short-first has something to reorder (docs/policies.md).
UNEQUAL4 = Scenario("mixed x4", 1.0, 4, (1.0, 0.5, 1.5, 1.0))
MODEL = (*FULL, WIDE)
"""The device model's default set (`--device model`)."""
ALL = (*FULL, CHURN, WIDE, UNEQUAL4)
QUICK = (Scenario("1:1 x2", 1.0, 2),)
