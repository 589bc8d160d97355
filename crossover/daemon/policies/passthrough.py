"""`passthrough`: observe and record only; every request is granted at once."""
from __future__ import annotations

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies._queues import QueuePolicy


class PassthroughPolicy(QueuePolicy):
    """Never blocks: the daemon records phases and timings but gates nothing.

    Useful to measure a job before scheduling it, and as the reference that
    must leave training bit-identical to plain Horovod.
    """

    name = "passthrough"
    blocks = False

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._q.add(rank)
        return []

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.remove(key)
        return []

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._q.grant(self._q.enqueue(key, now), key)
        return [key]

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.release(key)
        return []

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.cancel(key)
        return []


