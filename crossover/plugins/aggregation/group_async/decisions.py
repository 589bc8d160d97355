"""What rank 0 decides at a global boundary, for every rank to take: the groups, the stage, and the steps
each group plans over the next epoch. No I/O: measurements and state come in, a decision record goes out
(the record every rank receives by broadcast and the runtime's history keeps); the one state it changes is
the `Schedule` it is given, whose stage it advances."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from crossover.plugins.aggregation.group_async.grouping import Groups, speed_groups, steps_per_group
from crossover.plugins.aggregation.group_async.schedule import Schedule, Stage

__all__ = ["REGROUP_HYSTERESIS", "decide", "plan_steps"]

REGROUP_HYSTERESIS = 0.1
"""Regroup only when that cuts the waiting inside groups by this share of the ranks' summed pace."""


def plan_steps(groups: Groups, paces: list[float], samples: int, batch: int, synchronous: bool, world: int,
               balanced: bool) -> list[int]:
    """Steps per group over `samples`: in proportion to measured paces, else an even split."""
    measured = bool(paces) and all(math.isfinite(p) and p > 0 for p in paces)
    if samples <= 0:
        return [0] * len(groups)
    if measured and not synchronous:
        return steps_per_group(groups, paces, samples, batch, balanced=balanced)
    return [samples // (world * batch)] * len(groups)


def decide(kind: str, paces: list[float], change: Optional[float], samples: int, batch: int, *,
           schedule: Schedule, grouping: str, balanced: bool, configured: Groups, groups: Groups, stage: Stage,
           boundaries: int, world: int) -> dict[str, Any]:
    """The decision at a boundary of `kind` (`start` of an epoch, or `profile` end) from every rank's pace
    and the global model's `change` since the last mix (None: nothing was mixed)."""
    measured = all(math.isfinite(p) and p > 0 for p in paces)
    if kind == "profile":
        new_stage = schedule.after_profile()
    elif kind == "start" and boundaries > 0:
        new_stage = schedule.at_epoch(change)
    else:
        new_stage = schedule.stage
    count = len(configured)
    if change is None and boundaries > 0 and not stage.synchronous:
        chosen = groups  # nothing was mixed: a new group would hold different models
    elif new_stage.synchronous:
        chosen = (tuple(range(world)),)
    elif grouping == "speed" and measured:
        chosen = speed_groups(paces, count, groups if len(groups) == count else None, REGROUP_HYSTERESIS)
    else:
        chosen = configured if grouping == "static" or len(groups) != count else groups
    steps = plan_steps(chosen, paces, samples, batch, new_stage.synchronous, world, balanced)
    return {"groups": [list(g) for g in chosen], "steps": steps, "paces": paces, "change": change,
            "stage": dataclasses.asdict(new_stage)}
