"""What rank 0 decides at a global boundary, for every rank to take: the groups, the stage, and the steps
each group plans over the next epoch. No I/O: measurements and state come in, a decision record goes out
(the record every rank receives by broadcast and the runtime's history keeps); the one state it changes is
the `Schedule` it is given, whose stage it advances."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from crossover.plugins.aggregation.group_async.grouping import Groups, speed_groups, steps_per_group
from crossover.plugins.aggregation.group_async.schedule import Schedule, Stage

__all__ = ["REGROUP_HYSTERESIS", "Boundary", "Standing", "decide", "plan_steps"]

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


@dataclass(frozen=True)
class Boundary:
    """What the ranks bring to a boundary: its `kind` (`start` of an epoch, or `profile` end), every rank's
    pace, the global model's `change` since the last mix (None: nothing was mixed), and the samples and
    per-rank batch the next epoch is planned over."""

    kind: str
    paces: list[float]
    change: Optional[float]
    samples: int
    batch: int


@dataclass(frozen=True)
class Standing:
    """Where the job stands when it reaches a boundary: its schedule (whose stage `decide` advances) and
    current stage, the grouping rule, whether a group splits its batch by pace, the configured and the
    current groups, how many boundaries it has passed, and its number of ranks."""

    schedule: Schedule
    stage: Stage
    grouping: str
    balanced: bool
    configured: Groups
    groups: Groups
    boundaries: int
    world: int


def decide(at: Boundary, job: Standing) -> dict[str, Any]:
    """The decision at a boundary: the groups, the stage and each group's steps for the next epoch."""
    measured = all(math.isfinite(p) and p > 0 for p in at.paces)
    if at.kind == "profile":
        new_stage = job.schedule.after_profile()
    elif at.kind == "start" and job.boundaries > 0:
        new_stage = job.schedule.at_epoch(at.change)
    else:
        new_stage = job.schedule.stage
    count = len(job.configured)
    if at.change is None and job.boundaries > 0 and not job.stage.synchronous:
        chosen = job.groups  # nothing was mixed: a new group would hold different models
    elif new_stage.synchronous:
        chosen = (tuple(range(job.world)),)
    elif job.grouping == "speed" and measured:
        chosen = speed_groups(at.paces, count, job.groups if len(job.groups) == count else None, REGROUP_HYSTERESIS)
    else:
        chosen = job.configured if job.grouping == "static" or len(job.groups) != count else job.groups
    steps = plan_steps(chosen, at.paces, at.samples, at.batch, new_stage.synchronous, job.world, job.balanced)
    return {"groups": [list(g) for g in chosen], "steps": steps, "paces": at.paces, "change": at.change,
            "stage": dataclasses.asdict(new_stage)}
