"""A rank's stalls, told apart from its pace: what a group's shares cannot balance away. Pure.

A stall is a step much slower than the steps around it (a device held by a co-tenant, a paging storm).
A change of pace is not: when a rank slows down and stays slow, its later steps are as slow as the first
one. So each step counts as stalled by the part of its time above both its neighbours' (the step before
and the step after), and a level shift, however large, counts as nothing once it has lasted two steps.
"""
from __future__ import annotations

from collections import deque

__all__ = ["StallMeter"]


class StallMeter:
    """Seconds per sample lost to stalls, per step, since the last :meth:`take`."""

    def __init__(self) -> None:
        self._window: deque[float] = deque(maxlen=2)
        self._lost = 0.0
        self._steps = 0

    def observe(self, per_sample_s: float) -> None:
        """One more step's seconds per sample; the step before it is judged now that its successor is known."""
        if len(self._window) == 2:
            before, judged = self._window
            self._lost += max(0.0, judged - max(before, per_sample_s))
        self._window.append(per_sample_s)
        self._steps += 1

    def take(self) -> float:
        """The mean seconds per sample lost to stalls per step since the last call (0.0 without steps); the
        count starts again, the neighbours are kept."""
        mean = self._lost / self._steps if self._steps else 0.0
        self._lost, self._steps = 0.0, 0
        return mean
