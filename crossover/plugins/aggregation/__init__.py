"""How a job's gradients are combined: ``average``, ``sum``, ``adasum``, ``weighted`` (LB-BSP) or ``group_async``.

The rule comes from ``CROSSOVER_AGGREGATION`` or from :func:`set_aggregation`
(which wins; :mod:`.selection`). Without either, nothing changes: Horovod does
what the script asked for. The Horovod hook (:mod:`crossover.plugins.hook.horovod_torch`)
builds every ``hvd.DistributedOptimizer`` through :func:`distributed_optimizer`;
a script that does not use ``import crossover.auto`` can call
:func:`DistributedOptimizer` from this module instead. This module is the
public face of aggregation: every name in ``__all__`` is importable from here.

Rules
-----
``average`` / ``sum``
    Horovod's own optimizer with ``op=hvd.Average`` / ``op=hvd.Sum``.

``adasum``
    Adasum of the optimizer deltas, Horovod's native kernel where it can run
    and the plugin's :class:`AdasumOptimizer` elsewhere
    (:mod:`crossover.plugins.aggregation.adasum`).

``weighted``
    LB-BSP: per-rank batch sizes from :func:`batch_sampler` that follow each
    rank's speed, gradients weighted by the sizes on Horovod's averaging
    optimizer (:mod:`crossover.plugins.aggregation.lbbsp`).

``group_async``
    Synchronous data-parallel SGD inside groups of ranks (a Horovod process
    set each), asynchronous exchanges between groups through a parameter
    service with an SSP staleness bound; :func:`batch_sampler` shares each
    epoch among groups by pace (:mod:`crossover.plugins.aggregation.group_async`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crossover.plugins.aggregation.selection import prepare_horovod

if TYPE_CHECKING:
    from crossover.plugins.aggregation.api import (
        AdasumDecision,
        AdasumFacts,
        AdasumOptimizer,
        AggregationError,
        DistributedOptimizer,
        HorovodCollectives,
        LBBSPSampler,
        LBBSPSettings,
        Rule,
        adasum_path,
        aggregation_of,
        apply_measurements,
        batch_sampler,
        current_rule,
        decide,
        distributed_optimizer,
        end_group_async,
        group_async_stats,
        lbbsp_stats,
        replay_decisions,
        resolve_algorithm,
        set_aggregation,
        settings,
        use_settings,
        weight_scale,
    )

__all__ = [
    "AdasumDecision",
    "AdasumFacts",
    "AdasumOptimizer",
    "AggregationError",
    "DistributedOptimizer",
    "HorovodCollectives",
    "LBBSPSampler",
    "LBBSPSettings",
    "Rule",
    "adasum_path",
    "aggregation_of",
    "apply_measurements",
    "batch_sampler",
    "decide",
    "current_rule",
    "distributed_optimizer",
    "end_group_async",
    "group_async_stats",
    "lbbsp_stats",
    "replay_decisions",
    "resolve_algorithm",
    "set_aggregation",
    "settings",
    "use_settings",
    "weight_scale",
]

prepare_horovod()


def __getattr__(name: str) -> Any:
    """The public names load :mod:`.api` (and torch) on first use: the parameter service imports from this
    package's subpackages and needs neither."""
    if name in __all__:
        return getattr(importlib.import_module("crossover.plugins.aggregation.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
