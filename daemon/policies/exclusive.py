"""`exclusive`: first come, first served; at most one compute grant per device."""
from __future__ import annotations

from ..api import DeviceView, RankKey, RankRef
from ._queues import DeviceQueues, _Device


class ExclusivePolicy:
    """FIFO per device. Serializes compute phases but knows nothing of jobs.

    It is the baseline the `crossover` policy must beat: it prevents two
    jobs' kernels from thrashing the device, but does not align a job's ranks
    across nodes, so a job's allreduce can wait on a peer queued elsewhere.
    """

    name = "exclusive"
    blocks = True

    def __init__(self) -> None:
        self._q = DeviceQueues()

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

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        return None

    def tick(self, now: float) -> list[RankKey]:
        return []

    def holds(self, key: RankKey) -> bool:
        return key in self._q.device_of(key).holders

    def is_waiting(self, key: RankKey) -> bool:
        return key in self._q.device_of(key).waiting

    def view(self, device: int) -> DeviceView:
        dev = self._q.devices.get(device)
        if dev is None:
            return DeviceView(device, (), ())
        return DeviceView(device, tuple(dev.holders), tuple(dev.waiting))

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        if dev.holders or not dev.waiting:
            return []
        nxt = dev.waiting[0]
        self._q.grant(dev, nxt)
        return [nxt]
