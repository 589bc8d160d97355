"""What the emulated-cluster benchmark measures (`bench/emulated.py`): its scenarios and the modes each
scenario is measured in, with the daemon policy that stands for each mode."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLOCATED", "FULL", "MODES", "POLICY", "QUICK", "Scenario"]

MODES = ("sequential", "unscheduled", "exclusive", "turns", "crossover")
COLOCATED = MODES[1:]
POLICY = {"sequential": "passthrough", "unscheduled": "passthrough", "exclusive": "exclusive", "turns": "turns",
          "crossover": "crossover"}


@dataclass(frozen=True)
class Scenario:
    """A set of jobs co-located at one comm:compute ratio (of the first job).

    `batch_scale[k]` multiplies job k's batch (its compute phase); empty: identical jobs.
    """

    name: str
    ratio: float  # target comm:compute
    jobs: int
    batch_scale: tuple[float, ...] = ()

    def batch(self, k: int, base: int) -> int:
        scale = self.batch_scale[k] if self.batch_scale else 1.0
        return max(16, int(round(base * scale / 16)) * 16)


FULL = (Scenario("1:1 x2", 1.0, 2), Scenario("1:2 x2", 0.5, 2), Scenario("2:1 x2", 2.0, 2),
        Scenario("1:1 x3", 1.0, 3), Scenario("mixed x3", 1.0, 3, (1.0, 0.4, 1.6)))
QUICK = (Scenario("1:1 x2", 1.0, 2),)
