"""A process's LB-BSP state: what the sampler hands out and the weighted optimizer reads and adopts.

The script builds the sampler (``batch_sampler()``) and the optimizer
(``DistributedOptimizer``) separately, in either order; they meet in one
:class:`SamplerLink` that the aggregation module owns and hands to both: the
sampler's builder puts its :class:`LBBSPState` there, and every weighted
optimizer follows the newest one.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController

__all__ = ["LBBSPState", "SamplerLink", "TRACE_STEPS"]

TRACE_STEPS = 5000  # steps of shared measurements kept for the stats' "trace"


@dataclass
class LBBSPState:
    """Per-process LB-BSP state shared by the sampler and the weighted optimizer."""

    controller: BatchSizeController
    rank: int
    world_size: int
    dataset_length: int
    min_gain: float = 0.1
    # The adopted assignment: what the sampler hands out. The controller only
    # estimates speeds and proposes; :func:`~.adoption.decide` adopts.
    sizes: tuple[int, ...] = ()
    # (this rank's batch, global batch) of every batch the sampler has handed
    # out and no backward pass has consumed yet; appended on the training
    # thread, popped by gradient hooks.
    pending: collections.deque[tuple[int, int]] = field(default_factory=lambda: collections.deque(maxlen=1024))
    history: list[tuple[int, list[int]]] = field(default_factory=list)  # (first step, sizes)
    # The first TRACE_STEPS steps' shared measurements, [step][rank] = (batch, compute seconds):
    # what every rank's controller saw, so a run can be replayed offline against another rule.
    trace: list[list[tuple[int, float]]] = field(default_factory=list)
    overhead_s: float = 0.0
    compute_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0  # steps measured into this state (by every weighted optimizer that followed it)

    def __post_init__(self) -> None:
        self.sizes = tuple(self.controller.sizes)
        self.history.append((0, list(self.sizes)))

    def stats(self) -> dict[str, Any]:
        """Sizes, their history, the controller's cost so far and the trace (see ``lbbsp_stats()``)."""
        return {
            "sizes": list(self.sizes),
            "history": [[iteration, list(sizes)] for iteration, sizes in self.history],
            "speeds": list(self.controller.speeds),
            "steps": self.steps,
            "overhead_s": self.overhead_s,
            "compute_s": self.compute_s,
            "step_s": self.step_s,
            "trace": [[list(entry) for entry in step] for step in self.trace],
            "config": dataclasses.asdict(self.controller.config),
            "min_gain": self.min_gain,
        }


class SamplerLink:
    """Where the newest LB-BSP sampler's state is found (``None`` before the first sampler)."""

    def __init__(self) -> None:
        self.state: Optional[LBBSPState] = None
