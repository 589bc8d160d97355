"""`passthrough`: observe and record only; every request is granted at once."""
from __future__ import annotations

from ..api import DeviceView, RankKey, RankRef
from ._queues import DeviceQueues


class PassthroughPolicy:
    """Never blocks: the daemon records phases and timings but gates nothing.

    Useful to measure a job before scheduling it, and as the reference that
    must leave training bit-identical to plain Horovod.
    """

    name = "passthrough"
    blocks = False

    def __init__(self) -> None:
        self._q = DeviceQueues()

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
