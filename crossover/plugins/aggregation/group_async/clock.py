"""The stale-synchronous-parallel (SSP) clock the parameter service keeps: who may exchange now.

Each group's clock counts its exchange periods: one per exchange, or as many
periods as the group worked since its last one when a step outlasts the period
(a group whose steps take two periods exchanges once per step and ticks twice),
so clocks of groups of every pace advance with wall time alike. A group whose
next exchange would put it more than ``bound`` ticks ahead of the slowest active
group waits; so the model a group pulls never lacks more than ``bound`` periods'
worth of any active group's updates. A group that is parked (between epochs, finished,
or silent past the service's limit) is not waited for; when it exchanges
again its clock is lifted to the slowest active clock, so it cannot hold the
others back by the exchanges it missed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SSPClock"]


@dataclass
class SSPClock:
    """Clocks per group (a group is named by an int) and the bound ``s`` between them."""

    bound: int
    clocks: dict[int, int] = field(default_factory=dict)
    parked: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.bound < 0:
            raise ValueError(f"the staleness bound must be >= 0, not {self.bound}")

    def _active(self) -> list[int]:
        return [c for g, c in self.clocks.items() if g not in self.parked]

    def slowest(self) -> int | None:
        """The smallest clock among active groups; ``None`` when none is active."""
        active = self._active()
        return min(active) if active else None

    def gap(self, group: int) -> int:
        """How many exchanges ``group`` is ahead of the slowest active group (0 when it is the slowest)."""
        slowest = self.slowest()
        return 0 if slowest is None else max(0, self.clocks.get(group, slowest) - slowest)

    def activate(self, group: int) -> None:
        """``group`` takes part again (first contact or back from parking); its clock is lifted to the
        slowest active one, never lowered."""
        self.parked.add(group)  # the slowest among the others
        slowest = self.slowest()
        self.parked.discard(group)
        if group not in self.clocks:
            self.clocks[group] = slowest if slowest is not None else 0
        elif slowest is not None and self.clocks[group] < slowest:
            self.clocks[group] = slowest

    def tick(self, group: int, count: int = 1) -> None:
        """``group`` has exchanged once more, after ``count`` periods of work (at least one)."""
        if group in self.parked or group not in self.clocks:
            self.activate(group)
        self.clocks[group] += max(1, count)

    def may_proceed(self, group: int) -> bool:
        """Whether ``group`` is within the bound of the slowest active group."""
        return self.gap(group) <= self.bound

    def park(self, group: int) -> None:
        """Stop waiting for ``group`` (it is between epochs, finished, or gone silent)."""
        if group in self.clocks:
            self.parked.add(group)

    def level(self) -> None:
        """Every group has just seen every update (a full mix): all clocks equal the fastest."""
        top = max(self.clocks.values(), default=0)
        for group in self.clocks:
            self.clocks[group] = top
