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
    assert plan_steps(groups, [], 1280, 32, False, 4, True) == [10, 10]
    fast_first = plan_steps(groups, [0.001, 0.001, 0.004, 0.004], 1280, 32, False, 4, True)
    assert fast_first[0] > fast_first[1]
    assert plan_steps(groups, [0.001, 0.001, 0.004, 0.004], 1280, 32, True, 4, True) == [10, 10]
    assert plan_steps(groups, [0.1] * 4, 0, 32, False, 4, True) == [0, 0]


def test_a_boundary_decides_groups_stage_and_steps_from_what_the_ranks_bring():
    staged = Schedule("staged", 0.5, 4)
    configured = ((0, 1), (2, 3))
    everyone = ((0, 1, 2, 3),)
    job = Standing(staged, staged.stage, "speed", True, configured, everyone, boundaries=0, world=4)
    first = decide(Boundary("start", [math.nan] * 4, None, 1280, 32), job)
    assert first["groups"] == [[0, 1, 2, 3]] and first["stage"]["name"] == "profile" and first["steps"] == [10]
    paces = [0.001, 0.004, 0.001, 0.004]
    after = decide(Boundary("profile", paces, 0.0, 1280, 32),
                   Standing(staged, staged.stage, "speed", True, configured, everyone, boundaries=1, world=4))
    assert after["stage"]["name"] == "coarse" and staged.stage.name == "coarse"
    assert after["groups"] == [[0, 2], [1, 3]], "ranks of a pace together"
    assert after["steps"][0] > after["steps"][1]
