"""What rank 0 decides at a global boundary, for every rank to take: the groups, the stage, each group's
steps over the next epoch, and when the next global boundary is. No I/O: measurements and state come in,
a decision record goes out (the record every rank receives by broadcast and the runtime's history keeps).

Global boundaries are what speed grouping costs: every rank meets, the models are mixed, the groups'
process sets may be built. So they come only as often as the groups may change: after a boundary that
changed them, the next epoch; after one that kept them, twice as many epochs as the last time, up to
`LONGEST_INTERVAL`. A fixed straggler thus costs a few boundaries at the start and then almost none;
paces that change bring them back.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from crossover.plugins.aggregation.group_async.grouping import Groups, speed_groups, steps_per_group
from crossover.plugins.aggregation.group_async.schedule import Stage

__all__ = ["LONGEST_INTERVAL", "REGROUP_HYSTERESIS", "Boundary", "Standing", "decide", "plan_steps"]

REGROUP_HYSTERESIS = 0.1
"""Regroup only when that cuts the waiting inside groups by this share of the ranks' summed pace."""

LONGEST_INTERVAL = 8
"""At most this many epochs between two global boundaries of speed grouping."""


def plan_steps(groups: Groups, paces: list[float], samples: int, batch: int, world: int,
               balanced: bool) -> list[int]:
    """Steps per group over `samples`: in proportion to measured paces, else an even split."""
    measured = bool(paces) and all(math.isfinite(p) and p > 0 for p in paces)
    if samples <= 0:
        return [0] * len(groups)
    if measured:
        return steps_per_group(groups, paces, samples, batch, balanced=balanced)
    return [samples // (world * batch)] * len(groups)


@dataclass(frozen=True)
class Boundary:
    """What the ranks bring to a boundary: the `epoch` it starts, every rank's pace (mean compute seconds per
    sample, stalls included) and stalls (seconds per sample lost per step, `stalls.StallMeter`: what a group's
    shares cannot balance), the global model's `change` since the last mix (None: nothing was mixed), and the
    samples and per-rank batch the next epoch is planned over."""

    epoch: int
    paces: list[float]
    stalls: list[float]
    change: Optional[float]
    samples: int
    batch: int


@dataclass(frozen=True)
class Standing:
    """Where the job stands when it reaches a boundary: its stage, the grouping rule, whether a group splits its
    batch by pace, the configured and the current groups, how many boundaries it has passed, its number of
    ranks, and the epochs between the last two global boundaries."""

    stage: Stage
    grouping: str
    balanced: bool
    configured: Groups
    groups: Groups
    boundaries: int
    world: int
    interval: int = 1


def _chosen(at: Boundary, job: Standing) -> Groups:
    count = len(job.configured)
    measured = all(math.isfinite(p) and p > 0 for p in at.paces)
    if at.change is None and job.boundaries > 0:
        return job.groups  # nothing was mixed: a new group would hold different models
    if job.grouping == "speed" and measured:
        current = job.groups if len(job.groups) == count else None
        stalls = at.stalls if job.balanced and len(at.stalls) == len(at.paces) else None
        return speed_groups(at.paces, count, current, REGROUP_HYSTERESIS, stalls=stalls)
    return job.configured if job.grouping == "static" or len(job.groups) != count else job.groups


def decide(at: Boundary, job: Standing) -> dict[str, Any]:
    """The decision at a boundary: the groups, the stage, each group's steps for the next epoch, and the epoch
    of the next global boundary (``None``: there is none: static groups never change)."""
    chosen = _chosen(at, job)
    steps = plan_steps(chosen, at.paces, at.samples, at.batch, job.world, job.balanced)
    interval, next_boundary = 1, None
    if job.grouping == "speed":
        interval = 1 if chosen != job.groups or job.boundaries == 0 else min(2 * job.interval, LONGEST_INTERVAL)
        next_boundary = at.epoch + interval
    return {"groups": [list(g) for g in chosen], "steps": steps, "paces": at.paces, "stalls": at.stalls,
            "change": at.change, "stage": dataclasses.asdict(job.stage), "interval": interval,
            "next_boundary": next_boundary}
