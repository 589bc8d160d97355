"""The aggregation rules' one state for the life of a training process (`STATE`).

What a script chose in code (`set_aggregation`, `use_settings`), this package's own read of the environment
where the Horovod hook did not read it (`selection`), the newest LB-BSP sampler's state that every weighted
optimizer reads, the process's group_async runtime, and what must be drained before Horovod shuts
down. One process trains one rank, so there is one; the Horovod hook keeps its own
(`crossover.plugins.hook.runtime`).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from crossover.plugins.aggregation.lbbsp.state import SamplerLink
from crossover.settings import AggregationSettings

if TYPE_CHECKING:
    from crossover.plugins.aggregation.group_async.runtime import GroupRuntime

__all__ = ["STATE", "AggregationState"]


@dataclass
class AggregationState:
    """The aggregation rules' state; see the module's docstring."""

    selected: dict[str, Optional[str]] = field(  # set_aggregation's choice, over the environment's
        default_factory=lambda: {"rule": None, "adasum_impl": None, "adasum_algorithm": None})
    given: Optional[AggregationSettings] = None  # use_settings's, in place of the environment's
    read: Optional[AggregationSettings] = None  # the environment's, read here once where no hook read it
    lbbsp: SamplerLink = field(default_factory=SamplerLink)  # the newest sampler's state, for every hook
    group: Optional[GroupRuntime] = None  # shared by the group_async sampler and optimizer
    building: threading.local = field(default_factory=threading.local)  # `.active`: inside distributed_optimizer
    pending: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # LB-BSP shares still in flight
    drain_installed: bool = False  # whether Horovod's shutdown drains `pending` first
    hook_ids: Any = field(default_factory=itertools.count)  # weighted optimizers in build order, same on every rank


STATE = AggregationState()
