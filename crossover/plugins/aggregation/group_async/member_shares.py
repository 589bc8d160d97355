"""Inside one group: each member's share of the group's batch, cut by the members' paces (LB-BSP within
a group). Pure: the paces come in as numbers; every member decides from the same allreduced list, so
every member takes the same split."""
from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Optional

from crossover.plugins.aggregation.group_async.balance import member_batches

__all__ = ["MemberShares"]

_log = logging.getLogger(__name__)


class MemberShares:
    """The split of a group's batch among its members, and this member's recent pace at its share."""

    def __init__(self, balance: bool) -> None:
        self.balance = balance
        self.split: tuple[int, ...] = ()  # each member's samples per step, once re-split
        self._paces: list[float] = []  # each member's pace as the group last heard it
        self._recent: deque[float] = deque(maxlen=16)  # this member's seconds per sample at its current share

    def of(self, members: int, batch: int) -> tuple[int, ...]:
        """Each member's samples per step, in the group's rank order (equal until measured paces differ)."""
        if len(self.split) != members or sum(self.split) != members * batch:
            return (batch,) * members
        return self.split

    def observe(self, per_sample: float) -> None:
        self._recent.append(per_sample)

    def pace(self) -> float:
        """This member's seconds per sample at its current share (median of its recent steps; 0: none yet)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def note(self, paces: list[float]) -> None:
        """The members' paces as they rode in the group's allreduce: the same list on every member."""
        self._paces = paces

    @staticmethod
    def scale(shares: tuple[int, ...], index: int) -> float:
        """What member `index`'s mean gradient is multiplied by before the group averages, so that the
        average weighs every sample alike when members take unequal shares."""
        return len(shares) * shares[index] / sum(shares)

    def rebalance(self, members: int, batch: int) -> Optional[tuple[int, ...]]:
        """At a group's epoch start: re-split its batch by its members' paces; the new split, or None when
        it stays (balance off, or the paces not yet heard from every member)."""
        current = self.of(members, batch)
        if not self.balance or len(self._paces) != len(current):
            return None
        split = member_batches(sum(current), self._paces, current)
        if split == current:
            return None
        _log.info("group_async: a group re-splits its batch %s -> %s (seconds per sample %s)", list(current),
                  list(split), [round(p, 6) for p in self._paces])
        self.split = split
        self._recent.clear()
        return split

    def reset(self) -> None:
        self.split, self._paces = (), []
        self._recent.clear()
