"""Per-device bookkeeping shared by the queue-based policies."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from crossover.daemon.api import DeviceView, FailedPrecondition, NotFound, RankKey, RankRef
from crossover.daemon.policies.classes import JobClass
from crossover.daemon.policies.isolation import Change, IsolationView


@dataclass
class _Device:
    index: int
    holders: list[RankKey] = field(default_factory=list)
    waiting: deque[RankKey] = field(default_factory=deque)


class DeviceQueues:
    """Ranks per device, who holds each device and who waits, in request order."""

    def __init__(self) -> None:
        self.ranks: dict[RankKey, RankRef] = {}
        self.devices: dict[int, _Device] = {}
        self.requested_at: dict[RankKey, float] = {}
        self.iteration: dict[RankKey, int] = {}  # rank -> the iteration it waits for or computes

    def add(self, rank: RankRef) -> None:
        self.ranks[rank.key] = rank
        self.devices.setdefault(rank.device, _Device(rank.device))

    def remove(self, key: RankKey) -> int:
        ref = self._ref(key)
        dev = self.devices[ref.device]
        if key in dev.holders:
            dev.holders.remove(key)
        if key in dev.waiting:
            dev.waiting.remove(key)
        self.requested_at.pop(key, None)
        self.iteration.pop(key, None)
        del self.ranks[key]
        return ref.device

    def enqueue(self, key: RankKey, now: float, iteration: int = 0) -> _Device:
        dev = self.device_of(key)
        if key in dev.holders or key in dev.waiting:
            raise FailedPrecondition(f"rank {key} already holds or waits for its device")
        dev.waiting.append(key)
        self.requested_at[key] = now
        self.iteration[key] = iteration
        return dev

    def mates(self, dev: _Device) -> list[RankKey]:
        """Waiting ranks that may join the device's holders: ranks of the holding job in the holders'
        iteration. A job's ranks on one device compute one phase together: serialising them buys
        nothing (its allreduce waits for the last of them) and costs a hand-over each."""
        if not dev.holders:
            return []
        jobs = {(k.job_id, self.iteration.get(k, 0)) for k in dev.holders}
        if len(jobs) != 1:
            return []
        ((job, iteration),) = jobs
        return [k for k in dev.waiting if k.job_id == job and self.iteration.get(k, 0) == iteration]

    def grant(self, dev: _Device, key: RankKey) -> None:
        dev.waiting.remove(key)
        self.requested_at.pop(key, None)
        dev.holders.append(key)

    def release(self, key: RankKey) -> _Device:
        dev = self.device_of(key)
        if key not in dev.holders:
            raise FailedPrecondition(f"rank {key} released a grant it does not hold")
        dev.holders.remove(key)
        return dev

    def cancel(self, key: RankKey) -> _Device:
        dev = self.device_of(key)
        if key not in dev.waiting:
            raise FailedPrecondition(f"rank {key} has no pending request to withdraw")
        dev.waiting.remove(key)
        self.requested_at.pop(key, None)
        return dev

    def device_of(self, key: RankKey) -> _Device:
        return self.devices[self._ref(key).device]

    def _ref(self, key: RankKey) -> RankRef:
        try:
            return self.ranks[key]
        except KeyError:
            raise NotFound(f"rank {key} is not known to the policy") from None


class QueuePolicy:
    """Queries every queue-based policy answers the same way; subclasses decide grants."""

    def __init__(self) -> None:
        self._q = DeviceQueues()

    def holds(self, key: RankKey) -> bool:
        return key in self._q.device_of(key).holders

    def is_waiting(self, key: RankKey) -> bool:
        return key in self._q.device_of(key).waiting

    def occupy(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._q.grant(self._q.enqueue(key, now, iteration), key)
        return [key]

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        return None

    def tick(self, now: float) -> list[RankKey]:
        return []

    def classify(self, job_id: str, cls: JobClass, now: float) -> list[RankKey]:
        return []  # classes are the `crossover` policy's (policies.classes)

    def take_preemptions(self) -> list[RankKey]:
        return []

    def take_isolation_changes(self) -> list[tuple[int, Change]]:
        return []

    def isolating(self, device: int) -> bool:
        return False

    def isolation_view(self, device: int) -> IsolationView | None:
        return None

    def decisions(self) -> dict[str, int]:
        return {}

    def next_deadline(self) -> float | None:
        return None  # order-free policies wait for no deadline

    def view(self, device: int) -> DeviceView:
        dev = self._q.devices.get(device)
        if dev is None:
            return DeviceView(device, (), ())
        return DeviceView(device, tuple(dev.holders), tuple(dev.waiting), self._order(device))

    def _order(self, device: int) -> tuple[str, ...]:
        return ()


class DispatchPolicy(QueuePolicy):
    """A queue policy whose every event ends in one decision on the device it touched: `_dispatch`."""

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._q.add(rank)
        return []

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        return self._decide(self._q.devices[self._q.remove(key)])

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        return self._decide(self._q.enqueue(key, now, iteration))

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        return self._decide(self._q.release(key))

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        return self._decide(self._q.cancel(key))

    def _decide(self, dev: _Device) -> list[RankKey]:
        """The policy's grant on `dev`, then the granted job's other ranks there (`DeviceQueues.mates`)."""
        granted = self._dispatch(dev)
        for key in self._mates(dev):
            self._q.grant(dev, key)
            self._joined(key)
            granted.append(key)
        return granted

    def _mates(self, dev: _Device) -> list[RankKey]:
        """The waiting ranks that join the device's holders now (`DeviceQueues.mates`)."""
        return self._q.mates(dev)

    def _joined(self, key: RankKey) -> None:
        """`key` was granted beside its job's holders (policies forget what they kept on its request)."""

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        """The grants to make on `dev` now (at most one while nobody holds it)."""
        raise NotImplementedError
