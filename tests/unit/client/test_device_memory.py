"""The rank's side of the memory caps (`MemoryCaps`), against a fake device: when a cap is applied, what the
allocator is limited to, the one line, and the one error the plugin raises into training."""
from __future__ import annotations

import pytest

from crossover.client.rank import device_memory
from crossover.client.rank.device_memory import DeviceMemory, Footprint, MemoryCaps, OverMemoryCap

GiB = 1 << 30
WHY = "2.5 GiB of 10 GiB, as high reserves 7.5 GiB and the rest is left to it (the operator's crossoverd --reserve)"


class FakeDevice:
    name = "fake"

    def __init__(self, footprint: Footprint | None = None, frees_to: int | None = None) -> None:
        self.held = footprint
        self.frees_to = frees_to  # what the pool shrinks to when a lower limit gives cached memory back
        self.limits: list[int | None] = []
        self.callback = None
        self.broken = False

    def footprint(self) -> Footprint | None:
        if self.broken:
            raise OSError("the device is gone")
        return self.held

    def set_limit(self, pool_bytes: int | None) -> None:
        self.limits.append(pool_bytes)
        if pool_bytes is not None and self.held is not None and self.frees_to is not None:
            self.held = Footprint(min(self.held.pool, max(self.frees_to, 0)), self.held.outside)

    def on_refusal(self, callback) -> None:
        self.callback = callback

    def refusal(self, line: str) -> OverMemoryCap:
        return OverMemoryCap(line)


def caps() -> tuple[MemoryCaps, list[int]]:
    reports: list[int] = []
    return MemoryCaps("batch", reports.append), reports


def told_on(device: FakeDevice, limit: int | None, report=None) -> tuple[MemoryCaps, list[int]]:
    """Caps on `device`, told `limit` by the daemon and not applied yet (the next phase point does)."""
    reports: list[int] = []
    m = MemoryCaps("batch", report or reports.append)
    m.use(device)
    m.told(limit, WHY, 0)
    return m, reports


def test_a_fake_device_is_a_device_memory() -> None:
    assert isinstance(FakeDevice(), DeviceMemory)


def test_a_cap_waits_for_the_device_and_its_context_then_limits_the_pool_less_what_lies_outside() -> None:
    m, _ = caps()
    m.told(int(2.5 * GiB), WHY, 0)
    assert m.pending
    m.at_phase_point()  # no device yet
    device = FakeDevice(None)
    m.use(device)
    m.at_phase_point()  # no context yet: nothing measured, nothing applied
    assert device.limits == [] and m.pending and device.callback is None
    device.held = Footprint(GiB, GiB // 4)
    m.at_phase_point()
    assert device.limits == [int(2.5 * GiB) - GiB // 4] and not m.pending and m.pool_limit == device.limits[0]
    assert device.callback is not None  # refusals are watched from the first cap on
    m.told(int(2.5 * GiB), WHY, 0)  # the same word again: nothing to do
    assert not m.pending


def test_no_cap_no_observer_no_measurement() -> None:
    m, _ = caps()
    device = FakeDevice(Footprint(GiB, 0))
    device.broken = True  # any measurement would fail loudly
    m.use(device)
    for _ in range(device_memory.RECHECK_EVERY * 2):
        m.at_phase_point()
    assert device.limits == [] and device.callback is None


def test_a_cap_of_nothing_is_a_cap() -> None:
    device = FakeDevice(Footprint(0, GiB // 2))
    m, _ = told_on(device, 0)
    m.at_phase_point()
    assert device.limits == [0] and m.pool_limit == 0


def test_a_lifted_cap_lifts_the_limit_once() -> None:
    device = FakeDevice(Footprint(GiB, 0))
    m, _ = told_on(device, 2 * GiB)
    m.at_phase_point()
    m.told(None, "", 0)
    m.at_phase_point()
    m.at_phase_point()
    assert device.limits == [2 * GiB, None] and m.pool_limit is None


def test_what_lies_outside_the_allocator_is_measured_again_and_the_limit_follows() -> None:
    device = FakeDevice(Footprint(GiB, GiB // 4))
    m, _ = told_on(device, 4 * GiB)
    m.at_phase_point()
    device.held = Footprint(GiB, GiB)  # NCCL's buffers came at the first collective
    for _ in range(device_memory.RECHECK_EVERY - 1):
        m.at_phase_point()
    assert device.limits == [4 * GiB - GiB // 4]
    m.at_phase_point()
    assert device.limits == [4 * GiB - GiB // 4, 3 * GiB]


def test_a_rank_over_its_new_cap_gives_cached_memory_back_or_fails_at_once_with_the_line() -> None:
    device = FakeDevice(Footprint(3 * GiB, GiB // 2), frees_to=GiB)  # most of it was cached
    m, reports = told_on(device, 2 * GiB)
    m.at_phase_point()
    assert device.limits == [int(1.5 * GiB)] and reports == []

    device = FakeDevice(Footprint(3 * GiB, GiB // 2), frees_to=int(2.5 * GiB))  # live tensors hold 2.5 GiB
    m, reports = told_on(device, 2 * GiB)
    with pytest.raises(OverMemoryCap) as err:
        m.at_phase_point()
    assert str(err.value).startswith("crossover: job 'batch' ran out of its memory cap on device 0 asking for "
                                     "1 GiB more: it may hold 2.5 GiB of 10 GiB")
    assert "crossoverd --reserve" in str(err.value) and reports == [GiB]


def test_a_failing_device_never_stops_training_and_is_said_once(caplog) -> None:
    device = FakeDevice(Footprint(GiB, 0))
    device.broken = True
    m, _ = told_on(device, 2 * GiB)
    m.at_phase_point()
    m.told(3 * GiB, WHY, 0)
    m.at_phase_point()
    assert not m.pending and device.limits == []
    assert sum("could not apply the memory cap" in r.getMessage() for r in caplog.records) == 1


def test_a_refusal_is_told_once_per_allocation_and_only_under_a_cap() -> None:
    device = FakeDevice(Footprint(GiB, 0))
    m, reports = told_on(device, 2 * GiB)
    m.at_phase_point()
    line = device.callback(GiB // 2)
    assert line == m.line(GiB // 2) and "asking for 512 MiB more" in line and reports == [GiB // 2]
    m.told(None, "", 0)
    assert device.callback(GiB) == "" and reports == [GiB // 2] and m.refusals == 1


def test_a_failing_report_never_hides_the_error() -> None:
    def broken(asked: int) -> None:
        raise ConnectionError("daemon gone")

    device = FakeDevice(Footprint(GiB, 0))
    m, _ = told_on(device, 2 * GiB, broken)
    m.at_phase_point()
    assert device.callback(1).startswith("crossover: job 'batch'")
