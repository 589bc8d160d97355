"""How long a rank's blocking acquires waited, in bounded memory for the life of a job.

The first `KEEP` waits are kept in full: a benchmark drops its warm-up from them and reads their
percentiles. Every wait is counted in a histogram of log-spaced buckets (four a decade, from 1 µs
to 1000 s), so a job that runs for weeks keeps a few hundred numbers, not one per iteration.
"""
from __future__ import annotations

import math

__all__ = ["GrantWaits"]

_PER_DECADE = 4
_LOW_EXP, _HIGH_EXP = -6, 3  # 1 µs .. 1000 s
_FLOOR = 10.0 ** _LOW_EXP
_LAST = (_HIGH_EXP - _LOW_EXP) * _PER_DECADE + 1  # the bucket of 1000 s and above


class GrantWaits:
    """The waits of one rank's acquires: the first `KEEP` in order, all of them in a histogram."""

    KEEP = 4096

    def __init__(self) -> None:
        self.first: list[float] = []
        self.count = 0
        self.total_s = 0.0
        self._buckets = [0] * (_LAST + 1)  # below 1 µs, then a quarter decade each, then 1000 s and above

    def add(self, seconds: float) -> None:
        """One acquire's wait; a single call on the rank's hot path (the bucket is worked out inline)."""
        if len(self.first) < self.KEEP:
            self.first.append(seconds)
        self.count += 1
        self.total_s += seconds
        if seconds < _FLOOR:
            self._buckets[0] += 1
        else:
            self._buckets[min(1 + int((math.log10(seconds) - _LOW_EXP) * _PER_DECADE), _LAST)] += 1

    def add_many(self, waits: list[float]) -> None:
        """Several waits, oldest first (a rank folds its hot path's plain list in now and then)."""
        for seconds in waits:
            self.add(seconds)

    def __len__(self) -> int:
        return self.count

    @staticmethod
    def upper_edge(bucket: int) -> float:
        """The largest wait bucket `bucket` holds (seconds; inf for the last)."""
        if bucket >= _LAST:
            return math.inf
        return 10.0 ** (_LOW_EXP + bucket / _PER_DECADE)

    def histogram(self) -> dict[str, int]:
        """Each non-empty bucket by its upper edge in seconds (`"inf"` for the last): the stats file's form."""
        return {("inf" if math.isinf(self.upper_edge(i)) else f"{self.upper_edge(i):.3g}"): n
                for i, n in enumerate(self._buckets) if n}

    def quantile(self, q: float) -> float:
        """The upper edge of the bucket holding the `q` quantile of every wait (0 with none)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self._buckets):
            seen += n
            if seen >= rank and n:
                return self.upper_edge(i)
        return math.inf
