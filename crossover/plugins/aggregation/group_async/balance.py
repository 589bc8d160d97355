"""Splitting a group's batch among its ranks by measured pace: LB-BSP inside a group.

A group steps at its slowest member's pace. With equal shares, a rank four
times slower holds its whole group to a quarter of its capacity, and no
exchange period or weighting gives that capacity back. Giving each member a
share of the group's batch in proportion to its speed lets every member finish
its compute phase at about the same moment, so the group moves at the sum of
its members' speeds. The group's batch, and with it the group's step and its
region of the epoch, stays the same; only how it is cut changes.

Pure arithmetic on numbers every member of the group holds identically (they
ride in the group's gradient allreduce), so every member computes the same
split without another message.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from crossover.plugins.aggregation.lbbsp.apportion import apportion

__all__ = ["MIN_GAIN", "member_batches", "step_time"]

# Re-split only when that is predicted to shorten the group's step by this share: measurements scatter.
MIN_GAIN = 0.1


def step_time(paces: Sequence[float], batches: Sequence[int]) -> float:
    """The group's predicted compute phase: its slowest member's seconds per sample times its share."""
    return max(p * b for p, b in zip(paces, batches))


def member_batches(group_batch: int, paces: Sequence[float], current: Sequence[int],
                   min_gain: float = MIN_GAIN) -> tuple[int, ...]:
    """Each member's share of ``group_batch`` samples, in proportion to its speed (``1 / pace``, pace in
    seconds per sample), at least one sample each. ``current`` is kept unless the new split is predicted
    to shorten the group's step by more than ``min_gain`` of it, or while any pace is unmeasured."""
    if len(paces) != len(current) or sum(current) != group_batch:
        raise ValueError(f"paces {list(paces)} and shares {list(current)} do not describe a group of "
                         f"{group_batch} samples")
    if len(current) < 2 or not all(math.isfinite(p) and p > 0 for p in paces) or group_batch < len(current):
        return tuple(current)
    proposed = apportion(group_batch, [1.0 / p for p in paces], mins=[1] * len(paces))
    if step_time(paces, proposed) < (1.0 - min_gain) * step_time(paces, current):
        return tuple(proposed)
    return tuple(current)
