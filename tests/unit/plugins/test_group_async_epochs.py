"""How a group decides that its share of an epoch is done (GroupRuntime's per-step logic), on a fake
Horovod and a fake link: no processes, no sockets."""
from __future__ import annotations

import itertools
import math
from typing import Optional

import pytest

from crossover.plugins.aggregation.group_async.runtime import GroupRuntime
from crossover.plugins.aggregation.selection import AggregationError
from crossover.settings import AggregationSettings


class _Hvd:
    def __init__(self, rank: int, size: int = 4) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Link:
    """Answers progress calls with a scripted count of samples all groups have taken (None: away)."""

    def __init__(self, consumed: list[Optional[int]]) -> None:
        self.consumed = consumed
        self.calls: list[tuple[int, int]] = []

    def progress(self, epoch: int, taken: int) -> Optional[int]:
        self.calls.append((epoch, taken))
        return self.consumed.pop(0)


def _runtime(rank: int = 0, service: bool = True, samples: int = 1408, batch: int = 32,
             expected: float = math.inf) -> GroupRuntime:
    rt = GroupRuntime(_Hvd(rank), AggregationSettings(rule="group_async", groups="2", exchange_period_s=3600.0))
    rt._address = ("127.0.0.1", 1, "token") if service else None
    rt._batch = batch
    rt._enter_epoch(0, samples)  # an even plan: 11 steps per group of 2 ranks
    if expected is not math.inf:
        rt.account.expected = expected
    return rt


def test_without_the_service_a_group_takes_the_steps_it_was_planned():
    rt = _runtime(service=False)
    assert rt.account.nominal == [11, 11] and not rt.counted
    assert not rt.epoch_done(10) and rt.epoch_done(11)


def test_a_counted_group_runs_past_its_plan_until_the_epoch_is_used_up_or_it_alone_could_have_used_it():
    rt = _runtime()
    assert rt.counted and not rt.epoch_done(11) and not rt.epoch_done(21)
    assert rt.epoch_done(22)  # 1408 samples in steps of 2 x 32: the whole epoch for this group alone
    rt.account.over = True
    assert rt.epoch_done(3)


def test_the_leader_asks_the_service_only_near_its_expected_share_and_stops_when_the_epoch_is_used_up():
    rt = _runtime(expected=4)
    link = _Link([1000, 1408])
    rt.link = link  # type: ignore[assignment]
    flags = [rt.step_flags() for _ in range(4)]
    assert flags == [(False, False), (False, False), (False, False), (False, True)]
    assert link.calls == [(0, 192), (0, 256)]  # running totals of this group's samples, from step 3 on


def test_when_the_service_is_away_the_plan_decides():
    rt = _runtime(expected=2)
    rt.link = _Link([None] * 11)  # type: ignore[assignment]
    overs = [rt.step_flags()[1] for _ in range(11)]
    assert overs == [False] * 10 + [True]


def test_the_next_epoch_expects_the_share_the_group_took_of_the_last():
    rt = _runtime(expected=4)
    rt.link = _Link([1000, 1408])  # type: ignore[assignment]
    for _ in range(4):
        rt.step_flags()
    rt._enter_epoch(1, 1408)  # this group took 256 of the 1408 samples
    assert rt.account.steps == 0 and not rt.account.over
    assert math.isclose(rt.account.expected, 4.0)


class _SlowLink:
    """An exchange the SSP bound holds for a while before it answers."""

    consumed = None
    stage: Optional[str] = None  # the stage the service's answer names
    version = 0

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    def exchange(self, params, wait=True, scale=1.0, epoch=-1, taken=0, ticks=1):  # type: ignore[no-untyped-def]
        import time

        import torch

        self.ticks = ticks
        time.sleep(self.hold_s)
        return torch.cat([p.reshape(-1) for p in params])


def test_the_exchange_period_counts_from_the_answer_so_a_held_group_works_a_period_before_asking_again():
    import torch

    rt = GroupRuntime(_Hvd(0, size=1), AggregationSettings(rule="group_async", groups="1",
                                                           exchange_period_s=0.05))
    rt.params = [torch.zeros(3)]
    rt._address = None
    rt._enter_epoch(0, 0)
    rt.link = _SlowLink(hold_s=0.2)  # type: ignore[assignment]
    rt.exchange()
    assert rt.step_flags() == (False, False)  # held 0.2 s, four periods: still no new exchange due


def test_a_group_whose_step_outlasts_the_period_ticks_once_per_period_worked_not_once_per_exchange():
    import torch

    rt = GroupRuntime(_Hvd(0, size=1), AggregationSettings(rule="group_async", groups="1", exchange_period_s=0.1))
    rt.params = [torch.zeros(3)]
    rt._address = None
    rt._enter_epoch(0, 0)
    link = _SlowLink(hold_s=0.0)
    rt.link = link  # type: ignore[assignment]
    ticks = []
    for worked in (0.25, 0.25, 0.12, 0.05):  # a slow step, another, then a quick one, then a very quick one
        rt.account.last_exchange -= worked  # as if the group had worked that long since its last answer
        rt.exchange()
        ticks.append(link.ticks)
    # 2.5 periods: 2, the half carried; 2.5 + 0.5: 3; 1.2: 1 with 0.2 carried; 0.7: still at least 1
    assert ticks == [2, 3, 1, 1]


def test_a_leader_takes_the_stage_the_services_answer_names_and_ignores_one_its_schedule_lacks():
    import torch

    rt = GroupRuntime(_Hvd(0, size=1), AggregationSettings(rule="group_async", groups="1", group_schedule="staged",
                                                           exchange_period_s=0.5))
    rt.params = [torch.zeros(3)]
    rt._address = None
    rt._enter_epoch(0, 0)
    link = _SlowLink(hold_s=0.0)
    rt.link = link  # type: ignore[assignment]
    assert (rt.stage.name, rt.stage.period_s, rt.stage.bound) == ("profile", 0.5, 4)
    link.stage = "profile"
    rt.exchange()
    assert rt.stage.name == "profile" and not [h for h in rt.history if h["at"] == "stage"]
    link.stage = "coarse"
    rt.exchange()
    assert (rt.stage.name, rt.stage.period_s, rt.stage.bound) == ("coarse", 2.0, 8)
    link.stage = "fine"
    rt.exchange()
    assert (rt.stage.name, rt.stage.period_s, rt.stage.bound) == ("fine", 0.5, 4)
    assert [h["stage"]["name"] for h in rt.history if h["at"] == "stage"] == ["coarse", "fine"]
    link.stage = "warp"
    rt.exchange()
    assert rt.stage.name == "fine"


class _Versioned:
    version = 37


def test_a_checkpointed_state_resumes_the_version_stage_groups_and_paces():
    settings = AggregationSettings(rule="group_async", groups="2", group_schedule="staged", exchange_period_s=1.0)
    rt = GroupRuntime(_Hvd(0), settings)
    rt.stage = rt.schedule.stage = rt.schedule.coarse  # not where a fresh runtime starts
    rt.groups, rt._paces = ((0, 3), (1, 2)), [0.1, 0.2, 0.2, 0.1]
    rt.link = _Versioned()  # type: ignore[assignment]
    saved = rt.state_dict()
    assert saved["version"] == 37 and saved["schedule"]["stage"] == "coarse"

    resumed = GroupRuntime(_Hvd(0), settings)
    resumed.load_state_dict(saved)
    assert (resumed.stage.name, resumed.groups, resumed._paces) == ("coarse", ((0, 3), (1, 2)), [0.1, 0.2, 0.2, 0.1])
    assert resumed._start_version == 37

    elsewhere = GroupRuntime(_Hvd(0, size=8), settings)
    elsewhere.load_state_dict(saved)  # another world size: the stage stays, groups and paces are measured anew
    assert (elsewhere.stage.name, elsewhere._paces, elsewhere.groups) == ("coarse", [], elsewhere.configured)
    assert len(elsewhere.groups) == 2


def test_a_state_that_is_not_one_is_refused_and_training_begun_accepts_only_its_own():
    settings = AggregationSettings(rule="group_async", groups="2")
    rt = GroupRuntime(_Hvd(0), settings)
    with pytest.raises(AggregationError, match="not a state"):
        rt.load_state_dict({"schedule": {"kind": "fixed", "stage": "fixed"}})
    rt.started = True
    rt.load_state_dict(rt.state_dict())  # Horovod's broadcast_optimizer_state hands a rank its own back
    with pytest.raises(AggregationError, match="before training starts"):
        rt.load_state_dict({**rt.state_dict(), "version": 5})


# ---- a group's batch cut by its members' paces -------------------------------


def _member(rank: int, balance: bool = True) -> GroupRuntime:
    config = AggregationSettings(rule="group_async", groups="2", exchange_period_s=3600.0, group_balance=balance)
    rt = GroupRuntime(_Hvd(rank), config)
    rt._address = ("127.0.0.1", 1, "token")
    rt.started = True
    return rt


def test_a_group_re_splits_at_its_epoch_start_and_its_members_cover_its_region_exactly_once():
    from crossover.plugins.aggregation.group_async.sampler import GroupSampler

    members = [_member(2), _member(3)]
    batches = []
    for rt in members:
        sampler = GroupSampler(rt, dataset_length=1280, global_batch=128, shuffle=False)
        iter(sampler).__next__()  # epoch 0: equal shares, nothing measured yet
        assert rt.shares == (32, 32) and rt.grad_scale() == 1.0
        rt.note_member_paces([0.001, 0.004])  # as the group's allreduce carried them
        sampler.set_epoch(1)
        batches.append(list(itertools.islice(iter(sampler), 3)))
        assert rt.shares == (51, 13)
    assert [len(b) for b in batches[0]] == [51] * 3 and [len(b) for b in batches[1]] == [13] * 3
    # the group averages scale x mean gradient over 2 members: each member then counts by its samples
    assert [rt.grad_scale() / 2 for rt in members] == [51 / 64, 13 / 64]
    for step in range(3):  # each step takes the next 64 samples of group 1's region, cut 51 | 13
        taken = batches[0][step] + batches[1][step]
        start = 640 + 64 * step  # group 0's region comes first: 10 steps of 64
        assert taken == list(range(start, start + 64))


def test_a_measured_pace_is_per_sample_at_the_members_own_share():
    rt = _member(3)
    rt._batch = 32
    rt.members.split = (51, 13)
    rt.observe(0.052)
    assert math.isclose(rt.member_pace(), 0.004)


def test_with_balance_off_shares_stay_equal():
    from crossover.plugins.aggregation.group_async.sampler import GroupSampler

    rt = _member(3, balance=False)
    sampler = GroupSampler(rt, dataset_length=1280, global_batch=128, shuffle=False)
    iter(sampler).__next__()
    rt.note_member_paces([0.001, 0.004])
    sampler.set_epoch(1)
    assert len(next(iter(sampler))) == 32 and rt.shares == (32, 32)
