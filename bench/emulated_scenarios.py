"""What the emulated-cluster benchmark measures (`bench/emulated.py`): its scenarios and the modes each
scenario is measured in, with the daemon policy that stands for each mode."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLOCATED", "FULL", "MODES", "POLICY", "QUICK", "Scenario"]

MODES = ("sequential", "unscheduled", "exclusive", "crossover")
COLOCATED = MODES[1:]
POLICY = {"sequential": "passthrough", "unscheduled": "passthrough", "exclusive": "exclusive",
          "crossover": "crossover"}


@dataclass(frozen=True)
class Scenario:
    """A set of identical jobs co-located at one comm:compute ratio."""

    name: str
    ratio: float  # target comm:compute
    jobs: int


FULL = (Scenario("1:1 x2", 1.0, 2), Scenario("1:2 x2", 0.5, 2), Scenario("2:1 x2", 2.0, 2),
        Scenario("1:1 x3", 1.0, 3))
QUICK = (Scenario("1:1 x2", 1.0, 2),)
