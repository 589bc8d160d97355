"""`exclusive`: first come, first served; at most one compute grant per device."""
from __future__ import annotations

from ..api import RankKey, RankRef
from ._queues import QueuePolicy, _Device


class ExclusivePolicy(QueuePolicy):
    """FIFO per device. Serializes compute phases but knows nothing of jobs.

    It is the baseline the `crossover` policy must beat: it prevents two
    jobs' kernels from thrashing the device, but does not align a job's ranks
    across nodes, so a job's allreduce can wait on a peer queued elsewhere.
    """

    name = "exclusive"
    blocks = True

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._q.add(rank)
        return []

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        device = self._q.remove(key)
        return self._dispatch(self._q.devices[device])

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        return self._dispatch(self._q.enqueue(key, now))

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        return self._dispatch(self._q.release(key))

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        return self._dispatch(self._q.cancel(key))

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        if dev.holders or not dev.waiting:
            return []
        nxt = dev.waiting[0]
        self._q.grant(dev, nxt)
        return [nxt]
