"""The pure parts a group_async runtime composes, on their own: one group's epoch accounting on an injected
clock, the split of a group's batch among its members, and the plan of steps per group."""
from __future__ import annotations

import math

from crossover.plugins.aggregation.group_async.decisions import Boundary, Standing, decide, plan_steps
from crossover.plugins.aggregation.group_async.epoch_account import EpochAccount
from crossover.plugins.aggregation.group_async.member_shares import MemberShares
from crossover.plugins.aggregation.group_async.schedule import Schedule


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_exchange_is_due_a_period_after_the_last_answer_and_ticks_carry_the_part_period_over():
    clock = _Clock()
    acc = EpochAccount(clock)
    assert not acc.exchange_due(0.5)
    clock.now += 0.5
    assert acc.exchange_due(0.5)
    clock.now += 0.75  # 2.5 periods since the answer: 2 ticks, half a period carried
    assert acc.ticks(0.5) == 2
    acc.exchanged()
    clock.now += 0.25  # half a period more: with the carried half, one whole
    assert acc.ticks(0.5) == 1
    assert not acc.exchange_due(0.5)


def test_a_group_expects_its_share_of_the_last_epoch_and_a_new_grouping_forgets_it():
    acc = EpochAccount(_Clock())
    acc.enter(0, 1000, [10, 10], group=0, step_samples=50)
    assert acc.expected == 10
    acc.steps = 4
    assert acc.used_up(800, group=0) is False and acc.consumed == 800
    acc.enter(1, 1000, [10, 10], group=0, step_samples=50)  # took 200 of the 800 all groups took: a quarter
    assert math.isclose(acc.expected, 0.25 * 1000 / 50) and acc.steps == 0
    acc.forget_share()
    acc.enter(2, 1000, [7, 13], group=0, step_samples=50)
    assert acc.expected == 7


def test_without_the_service_the_plan_decides_and_never_past_the_whole_epoch():
    acc = EpochAccount(_Clock())
    acc.enter(0, 1000, [10, 30], group=1, step_samples=50)
    acc.steps = 30
    assert acc.used_up(None, group=1)
    assert not acc.done(19, counted=True, group=1, step_samples=50)
    assert acc.done(20, counted=True, group=1, step_samples=50)  # 20 steps of 50: the epoch for this group alone


def test_members_re_split_by_pace_only_with_every_pace_heard_and_balance_on():
    shares = MemberShares(balance=True)
    assert shares.of(2, 32) == (32, 32)
    assert shares.rebalance(2, 32) is None  # no paces yet
    shares.note([0.001, 0.004])
    split = shares.rebalance(2, 32)
    assert split is not None and sum(split) == 64 and split[0] > split[1]
    assert shares.of(2, 32) == split and shares.of(2, 16) == (16, 16)  # another batch: equal again
    assert MemberShares.scale(split, 0) == 2 * split[0] / 64
    off = MemberShares(balance=False)
    off.note([0.001, 0.004])
    assert off.rebalance(2, 32) is None


def test_steps_per_group_follow_measured_paces_else_split_evenly():
    groups = ((0, 1), (2, 3))
    assert plan_steps(groups, [], 1280, 32, 4, True) == [10, 10]
    fast_first = plan_steps(groups, [0.001, 0.001, 0.004, 0.004], 1280, 32, 4, True)
    assert fast_first[0] > fast_first[1]
    assert plan_steps(groups, [0.1] * 4, 0, 32, 4, True) == [0, 0]


def _standing(grouping: str, balanced: bool, groups: tuple[tuple[int, ...], ...], boundaries: int,
              interval: int = 1) -> Standing:
    return Standing(Schedule("fixed", 0.5, 4).stage, grouping, balanced, ((0, 1), (2, 3)), groups, boundaries,
                    world=4, interval=interval)


def test_a_boundary_decides_groups_and_steps_from_what_the_ranks_bring():
    configured = ((0, 1), (2, 3))
    first = decide(Boundary(0, [math.nan] * 4, [0.0] * 4, None, 1280, 32), _standing("speed", False, configured, 0))
    assert first["groups"] == [[0, 1], [2, 3]] and first["steps"] == [10, 10]  # nothing measured yet
    assert (first["interval"], first["next_boundary"]) == (1, 1)
    paces = [0.001, 0.004, 0.001, 0.004]
    after = decide(Boundary(1, paces, [0.0] * 4, 0.5, 1280, 32), _standing("speed", False, configured, 1))
    assert after["groups"] == [[0, 2], [1, 3]], "equal shares: ranks of a pace together"
    assert after["steps"][0] > after["steps"][1]
    assert (after["interval"], after["next_boundary"]) == (1, 2), "groups changed: look again next epoch"


def test_balanced_groups_regroup_only_for_stalls_and_meet_ever_less_often_while_nothing_changes():
    configured = ((0, 1), (2, 3))
    steady = [0.001, 0.004, 0.001, 0.004]  # different paces, no stalls: the shares balance them away
    intervals = []
    for boundary in range(1, 6):
        interval = intervals[-1] if intervals else 1
        kept = decide(Boundary(boundary, steady, [0.0] * 4, 0.5, 1280, 32),
                      _standing("speed", True, configured, boundary, interval))
        assert kept["groups"] == [[0, 1], [2, 3]]
        intervals.append(kept["interval"])
    assert intervals == [2, 4, 8, 8, 8]
    stalling = [0.001, 0.001, 0.001, 0.003]  # rank 3 loses 2 ms per sample to stalls its shares cannot balance
    same = decide(Boundary(9, stalling, [0.0, 0.0, 0.0, 0.002], 0.5, 1280, 32),
                  _standing("speed", True, configured, 6, 8))
    assert same["groups"] == [[0, 1], [2, 3]], "groups of one size: a staller holds as many others anywhere"
    uneven = ((0, 1, 2), (3, 4))
    apart = decide(Boundary(9, [0.001] * 4 + [0.003], [0.0, 0.002, 0.0, 0.0, 0.0], 0.5, 1600, 32),
                   Standing(Schedule("fixed", 0.5, 4).stage, "speed", True, uneven, uneven, 6, world=5, interval=8))
    assert apart["groups"] == [[0, 2, 3], [1, 4]], "the staller moves to the smaller group: it holds one rank"
    assert (apart["interval"], apart["next_boundary"]) == (1, 10)


def test_static_groups_have_no_later_boundary_and_nothing_regroups_without_a_mix():
    configured = ((0, 1), (2, 3))
    static = decide(Boundary(0, [0.001, 0.004, 0.001, 0.004], [0.0] * 4, None, 1280, 32),
                    _standing("static", True, configured, 0))
    assert static["groups"] == [[0, 1], [2, 3]] and static["next_boundary"] is None
    unmixed = decide(Boundary(3, [0.001, 0.004, 0.001, 0.004], [0.0] * 4, None, 1280, 32),
                     _standing("speed", False, configured, 2))
    assert unmixed["groups"] == [[0, 1], [2, 3]], "the service was away: the groups hold different models"
