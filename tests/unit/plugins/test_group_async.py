"""group_async's pure logic: the SSP clock, grouping, epoch shares, the staged schedule and the codecs."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.plugins.aggregation.group_async.balance import member_batches, step_time
from crossover.plugins.aggregation.group_async.clock import SSPClock
from crossover.plugins.aggregation.group_async.codec import Codec, decode
from crossover.plugins.aggregation.group_async.grouping import (
    GroupingError,
    parse_groups,
    speed_groups,
    static_groups,
    steps_per_group,
)
from crossover.plugins.aggregation.group_async.schedule import PRICED_AFTER, Schedule
from crossover.plugins.aggregation.group_async.stalls import StallMeter

# ---- SSP clock -------------------------------------------------------------


def test_a_group_more_than_the_bound_ahead_may_not_proceed_until_the_slowest_ticks():
    clock = SSPClock(bound=2)
    clock.activate(0)
    clock.activate(1)
    for _ in range(2):
        clock.tick(0)
    assert clock.may_proceed(0) and clock.gap(0) == 2
    clock.tick(0)
    assert not clock.may_proceed(0) and clock.gap(0) == 3
    clock.tick(1)
    assert clock.may_proceed(0)


def test_a_tick_counts_the_periods_a_group_worked_so_a_slow_stepper_keeps_pace_with_quick_ones():
    clock = SSPClock(bound=2)
    clock.activate(0)
    clock.activate(1)
    for _ in range(4):
        clock.tick(0)  # a quick group: one exchange per period
    assert not clock.may_proceed(0)
    clock.tick(1, 4)  # one step of four periods
    assert clock.may_proceed(0) and clock.gap(1) == 0
    clock.tick(1, 0)  # never less than one
    assert clock.clocks[1] == 5


def test_a_parked_group_is_not_waited_for_and_comes_back_at_the_slowest_clock():
    clock = SSPClock(bound=1)
    for g in (0, 1, 2):
        clock.activate(g)
    clock.park(2)
    for _ in range(5):
        clock.tick(0)
        clock.tick(1)
    assert clock.may_proceed(0) and clock.gap(0) == 0
    clock.activate(2)
    assert clock.clocks[2] == 5 and clock.gap(0) == 0


def test_a_full_mix_levels_every_clock():
    clock = SSPClock(bound=0)
    clock.activate(0)
    clock.activate(1)
    clock.tick(0)
    clock.tick(0)
    clock.tick(1)
    clock.level()
    assert set(clock.clocks.values()) == {2}


@settings(max_examples=200, deadline=None)
@given(bound=st.integers(0, 4), order=st.lists(st.integers(0, 2), min_size=1, max_size=80))
def test_a_service_that_lets_only_groups_within_the_bound_proceed_never_exceeds_it(bound, order):
    """Whatever order groups ask in, a group that ticks only when the clock lets it never sees a gap
    above the bound (how the service's wait keeps staleness bounded by construction)."""
    clock = SSPClock(bound)
    for g in range(3):
        clock.activate(g)
    for g in order:
        clock.tick(g)
        if not clock.may_proceed(g):  # it waits: roll its tick back until the slowest catches up
            clock.clocks[g] -= 1
        assert all(clock.gap(h) <= bound for h in range(3))


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError):
        SSPClock(-1)


# ---- groups ----------------------------------------------------------------


def test_group_specs_parse_counts_and_rank_lists():
    assert parse_groups("2", 4) == ((0, 1), (2, 3))
    assert parse_groups("3", 4) == ((0, 1), (2,), (3,))
    assert parse_groups("2,3;0,1", 4) == ((0, 1), (2, 3))
    assert parse_groups("0;1,2,3", 4) == ((0,), (1, 2, 3))
    for bad in ("", "x", "0,1;1,2,3", "0,1", "5", "0;;1,2,3"):
        with pytest.raises(GroupingError):
            parse_groups(bad, 4)


def test_static_groups_cover_every_rank_in_near_equal_sizes():
    groups = static_groups(7, 3)
    assert sorted(r for g in groups for r in g) == list(range(7))
    assert sorted(len(g) for g in groups) == [2, 2, 3]


def test_speed_grouping_puts_the_straggler_alone():
    assert speed_groups([1.0, 1.1, 0.9, 4.0], 2) == ((0, 1, 2), (3,))


def test_speed_grouping_keeps_the_current_groups_unless_the_gain_clears_the_hysteresis():
    current = ((0, 1), (2, 3))
    assert speed_groups([1.0, 1.0, 1.0, 1.05], 2, current, hysteresis=0.1) == current
    assert speed_groups([1.0, 1.0, 1.0, 4.0], 2, current, hysteresis=0.1) == ((0, 1, 2), (3,))


def test_speed_grouping_by_stalls_keeps_static_sizes_and_puts_the_stallers_together():
    paces = [1.0] * 8
    stalls = [0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.2, 0.9]
    assert speed_groups(paces, 2, stalls=stalls) == ((0, 2, 3, 4), (1, 5, 6, 7))


@settings(max_examples=60, deadline=None)
@given(stalls=st.lists(st.floats(0.0, 5.0), min_size=2, max_size=9), data=st.data())
def test_speed_grouping_by_stalls_always_has_static_sizes(stalls, data):
    count = data.draw(st.integers(1, len(stalls)))
    groups = speed_groups([1.0] * len(stalls), count, stalls=stalls)
    assert sorted(len(g) for g in groups) == sorted(len(g) for g in static_groups(len(stalls), count))


def _brute_force_cost(paces: list[float], count: int) -> float:
    best = float("inf")
    n = len(paces)
    for labels in itertools.product(range(count), repeat=n):
        if len(set(labels)) != count:
            continue
        groups = [[r for r in range(n) if labels[r] == g] for g in range(count)]
        best = min(best, sum(max(paces[r] for r in g) - paces[r] for g in groups for r in g))
    return best


@settings(max_examples=60, deadline=None)
@given(paces=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6), data=st.data())
def test_speed_grouping_is_the_least_waiting_partition(paces, data):
    count = data.draw(st.integers(1, len(paces)))
    groups = speed_groups(paces, count)
    cost = sum(max(paces[r] for r in g) - paces[r] for g in groups for r in g)
    assert cost == pytest.approx(_brute_force_cost(paces, count), abs=1e-9)


def test_steps_follow_each_groups_pace_and_never_overdraw_the_epoch():
    groups = ((0, 1), (2, 3))
    steps = steps_per_group(groups, [1.0, 1.0, 1.0, 4.0], samples=1000, batch=10)
    assert steps == [40, 10]  # 2 ranks at 1 s/sample against 2 at 4 s/sample: 4:1
    for paces in ([1.0, 1.0, 1.0, 1000.0], [1.0, 2.0, 3.0, 4.0]):
        steps = steps_per_group(groups, paces, samples=200, batch=16)
        assert min(steps) >= 1 and sum(s * 2 * 16 for s in steps) <= 200


def test_a_balanced_group_plans_at_the_sum_of_its_members_speeds():
    groups = ((0, 1), (2, 3))
    # unbalanced, group 1 moves at its straggler's pace (2 per 4 s); balanced at 1 + 1/4 per second
    assert steps_per_group(groups, [1.0, 1.0, 1.0, 4.0], samples=1000, batch=10) == [40, 10]
    assert steps_per_group(groups, [1.0, 1.0, 1.0, 4.0], samples=1000, batch=10, balanced=True) == [30, 19]


# ---- batch shares inside a group -------------------------------------------


def test_a_group_cuts_its_batch_by_speed_so_a_four_times_slower_member_takes_a_fifth():
    split = member_batches(64, [0.001, 0.004], (32, 32))
    assert split == (51, 13)
    assert step_time([0.001, 0.004], split) < 0.5 * step_time([0.001, 0.004], (32, 32))


def test_a_split_is_kept_unless_the_new_one_is_clearly_shorter_and_returns_to_equal_when_paces_do():
    assert member_batches(64, [0.001, 0.00105], (32, 32)) == (32, 32)  # 5 % apart: not worth a change
    assert member_batches(64, [0.001, 0.001], (51, 13)) == (32, 32)  # the straggler recovered
    assert member_batches(64, [0.001, 0.0], (32, 32)) == (32, 32)  # a member not measured yet
    assert member_batches(64, [0.001, math.nan], (32, 32)) == (32, 32)
    assert member_batches(2, [0.001, 0.1], (1, 1)) == (1, 1)  # every member keeps a sample


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-5, 1.0), min_size=2, max_size=8), st.integers(0, 200))
def test_a_split_always_sums_to_the_group_batch_and_gives_every_member_a_sample(paces, extra):
    batch = len(paces) + extra
    current = [batch // len(paces)] * len(paces)
    current[0] += batch - sum(current)
    split = member_batches(batch, paces, current)
    assert sum(split) == batch and min(split) >= 1
    assert step_time(paces, split) <= step_time(paces, current) + 1e-12


def test_a_split_that_does_not_describe_the_group_is_refused():
    with pytest.raises(ValueError):
        member_batches(64, [0.001, 0.004], (32, 31))
    with pytest.raises(ValueError):
        member_batches(64, [0.001], (32, 32))


# ---- schedule --------------------------------------------------------------


def test_staged_profiles_at_the_fine_setting_then_goes_coarse_where_exchanges_are_dear():
    schedule = Schedule("staged", period_s=0.5, bound=2)
    profile = schedule.stage
    assert (profile.name, profile.period_s, profile.bound) == ("profile", 0.5, 2)
    assert schedule.observe(80.0, 8.0).name == "profile"  # progress is not judged before the coarse stage
    for _ in range(PRICED_AFTER - 1):
        assert schedule.priced(0.4).name == "profile"  # across a thin link, but not judged yet
    coarse = schedule.priced(0.05)  # a median of 0.4 s against a period of 0.5 s
    assert (coarse.name, coarse.period_s, coarse.bound) == ("coarse", 2.0, 4)
    assert schedule.exchange_s == pytest.approx(0.4)
    assert schedule.priced(0.001).name == "coarse" and len(schedule.costs) == PRICED_AFTER, "judged once"


def test_the_coarse_stage_ends_once_the_rate_of_change_halves():
    schedule = Schedule("staged", period_s=0.5, bound=2)
    for _ in range(PRICED_AFTER):
        schedule.priced(0.4)
    assert schedule.window_s == 8.0  # four coarse periods
    assert schedule.observe(80.0, 8.0).name == "coarse"  # 10 per second: the peak so far
    assert schedule.observe(12.0, 2.0).name == "coarse"  # 6 per second: above half the peak
    assert schedule.observe(1.0, 0.0).name == "coarse"  # no time passed: nothing to judge
    fine = schedule.observe(39.0, 8.0)  # 4.9 per second
    assert (fine.name, fine.period_s, fine.bound) == ("fine", 0.5, 2)
    assert schedule.observe(800.0, 8.0).name == "fine"  # never back
    assert schedule.priced(0.4).name == "fine"


def test_where_exchanges_cost_little_the_profile_stage_goes_straight_to_fine():
    cheap = Schedule("staged", period_s=0.5, bound=2)
    for _ in range(PRICED_AFTER - 1):
        assert cheap.priced(0.005).name == "profile"  # 5 ms against a period of 0.5 s: not judged yet
    assert cheap.priced(0.005).name == "fine" and cheap.exchange_s == pytest.approx(0.005)
    edge = Schedule("staged", period_s=0.5, bound=2)
    for _ in range(PRICED_AFTER):
        stage = edge.priced(0.05)
    assert stage.name == "coarse", "a tenth of the period is dear enough"
    fixed = Schedule("fixed", period_s=0.5, bound=2)
    assert all(fixed.priced(0.001).name == "fixed" for _ in range(PRICED_AFTER))


def test_fixed_keeps_its_period_and_bound():
    schedule = Schedule("fixed", period_s=1.0, bound=3)
    assert schedule.observe(10.0, 1.0) == schedule.observe(0.1, 1.0) == schedule.stage == schedule.named("fixed")
    with pytest.raises(ValueError):
        schedule.named("coarse")
    with pytest.raises(ValueError):
        Schedule("sometimes", 1.0, 1)


def test_a_restored_schedule_keeps_its_stage_and_the_plateau_it_measured_against():
    schedule = Schedule("staged", period_s=0.5, bound=2)
    for _ in range(PRICED_AFTER):
        schedule.priced(0.4)
    schedule.observe(10.0, 1.0)
    saved = schedule.state()
    resumed = Schedule("staged", period_s=0.5, bound=2)
    assert resumed.restore(saved).name == "coarse"
    assert resumed.observe(6.0, 1.0).name == "coarse"  # still against the 10 per second seen before the restart
    assert resumed.observe(4.9, 1.0).name == "fine"
    profiling = {"kind": "staged", "stage": "profile", "peak_rate": 0.0}
    again = Schedule("staged", 0.5, 2)
    assert again.restore(profiling).name == "profile" and again.costs == [], "prices its exchanges again"
    with pytest.raises(ValueError):
        Schedule("fixed", 0.5, 2).restore(saved)  # another kind's stages mean something else
    with pytest.raises(ValueError):
        Schedule("staged", 0.5, 2).restore({**saved, "stage": "warp"})


# ---- codecs ----------------------------------------------------------------


def test_fp32_is_exact_and_fp16_is_close():
    update = torch.randn(1000)
    assert np.array_equal(decode("fp32", Codec("fp32").encode(update), 1000), update.numpy())
    half = decode("fp16", Codec("fp16").encode(update), 1000)
    assert np.allclose(half, update.numpy(), rtol=1e-3, atol=1e-3)
    assert len(Codec("fp16").encode(update)) == 2000


def test_topk_sends_a_fraction_and_error_feedback_loses_nothing():
    torch.manual_seed(0)
    codec = Codec("topk", fraction=0.1)
    total_sent = np.zeros(500, dtype=np.float32)
    total = torch.zeros(500)
    for _ in range(20):
        update = torch.randn(500)
        total += update
        payload = codec.encode(update)
        assert len(payload) == 50 * 8
        total_sent += decode("topk", payload, 500)
    assert codec.residual is not None
    assert np.allclose(total_sent + codec.residual.numpy(), total.numpy(), atol=1e-4)


@pytest.mark.parametrize("values", ["random", "all equal", "two values"])
@pytest.mark.parametrize("k", [1, 7, 500, 9_999, 10_000])
def test_the_services_topk_picks_the_k_largest_entries_even_among_ties(values: str, k: int):
    from crossover.plugins.aggregation.group_async.codec import _largest

    rng = np.random.default_rng(k)
    magnitude = {"random": np.abs(rng.standard_normal(10_000)), "all equal": np.full(10_000, 0.5),
                 "two values": np.where(rng.random(10_000) < 0.3, 2.0, 1.0)}[values].astype(np.float32)
    index = _largest(magnitude, k)
    assert index.size == k and np.unique(index).size == k
    assert np.array_equal(np.sort(magnitude[index]), np.sort(magnitude)[-k:])


# ---- stalls ----------------------------------------------------------------


def test_a_stall_is_a_step_above_both_its_neighbours_and_a_lasting_slowdown_is_none():
    meter = StallMeter()
    for pace in (1.0, 1.0, 9.0, 1.0, 1.0):  # one step held 8 units too long
        meter.observe(pace)
    assert meter.take() == 8.0 / 5
    for pace in (1.0, 3.0, 3.0, 3.0, 3.0, 3.0):  # slowed 3x, and stays slow
        meter.observe(pace)
    assert meter.take() == 0.0
    assert meter.take() == 0.0  # nothing since
    meter.observe(5.0)  # after 3, 3: the last 3 is not above 5
    meter.observe(3.0)  # now 5 is judged: 2 above its higher neighbour
    assert meter.take() == 2.0 / 2


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 5, (1 << 19) * 3 + 7])
def test_passes_split_across_threads_cover_every_value_once(threads, n):
    from crossover.plugins.aggregation.group_async.passes import Passes

    passes = Passes(threads)
    a = np.arange(n, dtype=np.float32)
    b = np.full(n, 2.0, dtype=np.float32)
    out = np.zeros(n, dtype=np.float32)
    assert np.array_equal(passes.add(a, b, out=out), a + 2.0)
    assert np.array_equal(passes.subtract(out, b, out=out), a)
    copied = passes.copy(a, out=np.empty(n, dtype=np.float32))
    assert np.array_equal(copied, a)
    pieces: list[slice] = []
    passes.run(pieces.append, n)
    covered = sorted(i for piece in pieces for i in range(n)[piece])
    assert covered == list(range(n))
    if threads > 1 and n >= 2 * (1 << 19):
        assert len(pieces) > 1


def test_passes_refuse_no_threads():
    from crossover.plugins.aggregation.group_async.passes import Passes

    with pytest.raises(ValueError, match="threads"):
        Passes(0)
