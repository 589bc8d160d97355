"""Straggler injection: spec parsing and proportional busy work under a fake clock."""
from __future__ import annotations

import pytest

from testbed.faults import (
    Drift,
    Straggler,
    StragglerSpecError,
    make_matmul_work,
    parse_straggler_spec,
)


class FakeClock:
    """A clock that only moves when a unit of fake work runs."""

    def __init__(self, unit: float) -> None:
        self.now = 100.0
        self.unit = unit
        self.units = 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.units += 1
        self.now += self.unit


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("3:3.0", {3: 3.0}),
        ("1:2.0,3:3.0", {1: 2.0, 3: 3.0}),
        (" 0:1 , 2 : 1.5 ", {0: 1.0, 2: 1.5}),
        ("", {}),
        ("   ", {}),
    ],
)
def test_parse_valid(spec: str, expected: dict[int, float]) -> None:
    assert parse_straggler_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("3", "'3'"),
        ("a:2", "'a'"),
        ("3:x", "'x'"),
        ("-1:2", "-1"),
        ("3:0.5", "0.5"),
        ("3:nan", "nan"),
        ("3:inf", "inf"),
        ("1:2,1:3", "rank 1 appears twice"),
        ("1:2,", "''"),
        ("3:2:1", "'2:1'"),
    ],
)
def test_parse_invalid(spec: str, named: str) -> None:
    with pytest.raises(StragglerSpecError, match=named) as info:
        parse_straggler_spec(spec)
    assert isinstance(info.value, ValueError)


def test_extra_work_is_proportional_to_compute_time() -> None:
    clock = FakeClock(unit=0.001)
    straggler = Straggler(3.0, clock=clock, work=clock.work)
    spent = straggler.slow_down(0.1)  # (3 - 1) x 0.1 s = 0.2 s = 200 units
    assert spent == pytest.approx(0.2, abs=0.001)
    assert clock.units in (200, 201)
    spent = straggler.slow_down(0.05)
    assert spent == pytest.approx(0.1, abs=0.001)


def test_overshoot_is_carried_so_the_total_tracks_the_factor() -> None:
    clock = FakeClock(unit=0.003)  # coarse units: every call over- or undershoots
    straggler = Straggler(1.5, clock=clock, work=clock.work)
    for _ in range(100):
        straggler.slow_down(0.01)
    assert straggler.total_extra_seconds == pytest.approx(0.5 * 0.01 * 100, abs=0.003)


def test_factor_one_and_unlisted_ranks_do_nothing() -> None:
    clock = FakeClock(unit=0.001)
    straggler = Straggler.for_rank("1:2.0,3:3.0", 2, clock=clock, work=clock.work)
    assert not straggler.active and straggler.factor == 1.0
    assert straggler.slow_down(5.0) == 0.0 and clock.units == 0
    assert Straggler.for_rank({3: 3.0}, 3, clock=clock, work=clock.work).factor == 3.0
    assert Straggler.for_rank("1:2.0,3:3.0", 1).factor == 2.0


def test_bad_arguments() -> None:
    with pytest.raises(StragglerSpecError):
        Straggler(0.5)
    straggler = Straggler(2.0, clock=FakeClock(0.001), work=lambda: None)
    with pytest.raises(ValueError, match="-1"):
        straggler.slow_down(-1.0)


def test_default_work_is_a_real_matmul() -> None:
    pytest.importorskip("torch")
    work = make_matmul_work(size=8)
    work()
    straggler = Straggler(2.0)  # real clock, real matmuls; a lower bound holds by construction
    assert straggler.slow_down(0.002) >= 0.002


def test_a_drift_slows_a_rank_only_inside_its_windows():
    clock = FakeClock(0.001)
    drift = Drift.for_rank("5:3@20-60,6:2@0-10,5:1.5@80-90", 5, clock=clock, work=clock.work)
    assert [drift.factor_at(t) for t in (0, 19.9, 20, 59.9, 60, 85, 95)] == [1, 1, 3, 3, 1, 1.5, 1]
    assert drift.slow_down(0.1, at_s=10.0) == 0.0 and clock.units == 0  # before its window: its own pace
    assert drift.slow_down(0.1, at_s=30.0) == pytest.approx(0.2)  # 3x: two more of every second it computed
    assert drift.slow_down(0.1, at_s=85.0) == pytest.approx(0.05)
    assert Drift.for_rank("5:3@20-60", 4).factor_at(30) == 1.0  # a rank the spec does not name


@pytest.mark.parametrize("spec", ["5:3", "5:3@60-20", "5:0.5@0-10", "x:3@0-10", "5:3@0-10,5:2@5-20"])
def test_a_bad_drift_spec_says_so(spec: str):
    with pytest.raises(StragglerSpecError):
        Drift.for_rank(spec, 5)
