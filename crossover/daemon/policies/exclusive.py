"""`exclusive`: first come, first served; one job computes on a device at a time."""
from __future__ import annotations

from crossover.daemon.api import RankKey
from crossover.daemon.policies._queues import DispatchPolicy, _Device


class ExclusivePolicy(DispatchPolicy):
    """FIFO per device. Serializes compute phases but knows nothing of jobs.

    It is the baseline the `crossover` policy must beat: it prevents two
    jobs' kernels from thrashing the device, but does not align a job's ranks
    across nodes, so a job's allreduce can wait on a peer queued elsewhere.
    """

    name = "exclusive"
    blocks = True

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        if dev.holders or not dev.waiting:
            return []
        nxt = dev.waiting[0]
        self._q.grant(dev, nxt)
        return [nxt]
