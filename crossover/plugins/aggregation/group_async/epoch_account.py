"""One group's walk through an epoch, as its leader counts it: steps taken, when the epoch is used up,
and when the next exchange is due. Pure: the clock is injected, the service's answers are passed in.

Within an epoch, groups take samples until the epoch is used up, as the parameter service counts it:
each exchange reports the samples the group took, and the answer says how many all groups have taken.
A group that stalls therefore takes a smaller share, and the others a larger one. Without the service,
a group takes the steps the last decision planned for it (`nominal`).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

__all__ = ["EpochAccount"]


class EpochAccount:
    """The current epoch of one group: `samples` in all, `nominal` planned steps per group, `steps` taken."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.epoch = 0
        self.samples = 0
        self.nominal: list[int] = []  # steps per group the last decision gave: the plan without the service
        self.over = False  # the service said the epoch is used up
        self.steps = 0
        self.expected = math.inf  # leader: the steps its group is expected to take (exchange each step after)
        self.consumed = 0  # leader: samples all groups took this epoch, as the last answer said
        self.share: Optional[float] = None  # leader: its group's share of the last epoch it finished
        self.last_exchange = clock()
        self._tick_credit = 0.0  # periods worked since the last exchange, not yet ticked

    def enter(self, epoch: int, samples: int, nominal: list[int], group: int, step_samples: int) -> None:
        """Start `epoch` with the plan `nominal`; `group` is this group's index, `step_samples` what one of
        its steps takes. A leader expects its group's share of the last epoch again."""
        taken = self.taken(step_samples)
        if self.consumed > 0 and taken > 0:
            self.share = taken / self.consumed
        self.epoch, self.samples, self.nominal = epoch, samples, list(nominal)
        if samples <= 0:
            self.expected = math.inf
        elif self.share is not None:
            self.expected = self.share * samples / step_samples
        else:
            self.expected = self.nominal[group]
        self.over = False
        self.steps = self.consumed = 0

    def forget_share(self) -> None:
        """New groups: no share of the last epoch carries over."""
        self.share, self.consumed = None, 0

    def taken(self, step_samples: int) -> int:
        """Samples this group has taken from the epoch so far."""
        return self.steps * step_samples

    def near_expected(self, group: int) -> bool:
        """Whether the group is within a step of what it is expected (or planned) to take."""
        return self.steps >= min(self.expected, self.nominal[group]) - 1

    def used_up(self, consumed: Optional[int], group: int) -> bool:
        """Whether the epoch is used up, from the service's count (`None`: it is away, and the group's
        planned steps decide)."""
        if consumed is None:
            return self.steps >= self.nominal[group]
        self.consumed = consumed
        return self.samples > 0 and consumed >= self.samples

    def done(self, steps: int, counted: bool, group: int, step_samples: int) -> bool:
        """Whether the group has finished the epoch after `steps` steps: the service said the epoch is used
        up, or (not `counted` by the service) the group took its planned steps; never more steps than the
        whole epoch holds for the group alone."""
        cap = self.samples // step_samples if self.samples else 0
        if self.over or steps >= cap:
            return True
        return not counted and steps >= self.nominal[group]

    def exchange_due(self, period_s: float) -> bool:
        return self._clock() - self.last_exchange >= period_s

    def exchanged(self) -> None:
        """The period counts from the answer: a group held at the bound works a full period before asking again."""
        self.last_exchange = self._clock()

    def ticks(self, period_s: float) -> int:
        """The exchange periods this group worked since its last exchange, whole ones, the rest carried to the
        next: a group whose step outlasts the period ticks the service's clock as often as a quick group
        does in the same time, so the staleness bound does not hold quick groups to a slow group's steps."""
        self._tick_credit += (self._clock() - self.last_exchange) / max(period_s, 1e-9)
        ticks = max(1, int(self._tick_credit))
        self._tick_credit -= ticks
        return ticks
