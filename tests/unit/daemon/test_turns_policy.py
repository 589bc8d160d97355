"""The `turns` policy, driven directly with explicit `now` values.

Row by row: alternation, bounded waiting then skip, an owner that leaves, the
cyclic order of three jobs and what `view` shows; then the tie-break setting
(the job id, the same on every node, or each node's own join order). Random
event sequences are in `test_crossover_random`, several nodes in
`test_crossover_nodes`.
"""
from __future__ import annotations

import pytest

from crossover.daemon.api import RankKey, RankRef
from testbed.simulator.turns import TurnsPolicy, TurnsSettings
from tests.unit.daemon._turns_fixtures import A, B, C, S, joined, ref

NOSYNC = TurnsSettings(tiebreak="join_order")


# ---- row by row -----------------------------------------------------------------------------


def test_two_jobs_alternate_on_a_device():
    p = joined(A, B)
    assert p.name == "turns" and p.blocks is True
    assert p.request(A.key, 0, now=1.0) == [A.key]
    assert p.request(B.key, 0, now=1.01) == []
    assert p.release(A.key, now=1.05) == [B.key]  # A's allreduce overlaps B's compute
    assert p.request(A.key, 1, now=1.08) == []  # A is back before B is done: it waits
    assert p.release(B.key, now=1.10) == [A.key]
    assert p.request(B.key, 1, now=1.13) == []
    assert p.release(A.key, now=1.15) == [B.key]
    assert p.view(0).holders == (B.key,)


def test_the_job_furthest_behind_goes_first_not_the_first_requester():
    p = joined(A, B)
    p.request(A.key, 0, now=1.0)
    p.request(B.key, 0, now=1.01)
    p.release(A.key, now=1.05)  # B computes iteration 0
    p.request(A.key, 1, now=1.06)
    p.release(B.key, now=1.08)  # A (iteration 1) computes; B's allreduce runs
    p.request(B.key, 1, now=1.09)  # both at iteration 1 now ...
    assert p.release(A.key, now=1.10) == [B.key]  # ... B, whose iteration is not done, goes before A's next
    assert p.request(A.key, 2, now=1.11) == []
    # B holds; next is A (its iteration 2), then B's iteration 2.
    assert p.order(0) == ["a", "b"] and p.view(0).order == ("name-a", "name-b")


def test_bounded_wait_for_a_late_owner_then_the_ready_job_goes():
    p = joined(A, B)
    p.request(A.key, 0, now=1.0)
    p.request(B.key, 0, now=1.0)
    p.release(A.key, now=1.05)  # B computes
    p.request(A.key, 1, now=1.06)
    p.release(B.key, now=1.10)  # A computes iteration 1
    p.request(B.key, 1, now=1.11)
    assert p.release(A.key, now=1.12) == [B.key]
    # B releases; A (iteration 2 next) and B (iteration 2 next): A is the owner but in its allreduce.
    assert p.release(B.key, now=1.15) == []
    assert p.request(B.key, 2, now=1.16) == []  # held for A, expected back at 1.12 + initial wait
    deadline = p.next_deadline()
    assert deadline == pytest.approx(1.12 + S.initial_wait_s)
    assert p.tick(deadline - 0.001) == []
    assert p.tick(deadline) == [B.key] and p.timeouts == 1


def test_late_owner_is_not_waited_for_again_until_it_asks():
    p = joined(A, B)
    p.request(A.key, 0, now=1.0)
    p.release(A.key, now=1.01)  # A goes into a long pause (evaluation, say)
    p.request(B.key, 0, now=1.02)  # A's iteration 1 > B's 0: B is served
    assert p.view(0).holders == (B.key,)
    p.release(B.key, now=1.03)
    assert p.request(B.key, 1, now=1.04) == []  # A (owner) is waited for once ...
    assert p.tick(1.01 + S.initial_wait_s) == [B.key]
    p.release(B.key, now=1.07)
    assert p.request(B.key, 2, now=1.08) == [B.key]  # ... then B runs freely until A asks again
    p.release(B.key, now=1.09)
    assert p.request(A.key, 1, now=1.10) == [A.key]


def test_backfill_when_the_ready_job_fits_before_the_owner_is_back():
    p = joined(A, B)
    p.observe(A.key, "comm", 0.100, now=0.5)  # A's allreduce takes ~100 ms
    p.observe(B.key, "compute", 0.020, now=0.5)  # B computes in ~20 ms
    p.request(A.key, 5, now=1.0)
    p.request(B.key, 5, now=1.0)
    assert p.release(A.key, now=1.02) == [B.key]
    p.release(B.key, now=1.04)
    # A (iteration 6 next, id a) is the owner but expected back only at 1.02 + 1.2 * 0.1.
    assert p.request(B.key, 6, now=1.05) == [B.key] and p.backfills == 1


def test_no_backfill_when_it_would_delay_the_owner():
    p = joined(A, B)
    p.observe(A.key, "comm", 0.010, now=0.5)
    p.observe(B.key, "compute", 0.050, now=0.5)
    p.request(A.key, 5, now=1.0)
    p.request(B.key, 5, now=1.0)
    p.release(A.key, now=1.02)
    p.release(B.key, now=1.025)
    assert p.request(B.key, 6, now=1.026) == []  # 50 ms of B would not fit before A is back (~1.032)
    assert p.request(A.key, 6, now=1.03) == [A.key]


def test_owner_leaving_frees_the_device_at_once():
    p = joined(A, B)
    p.request(A.key, 0, now=1.0)
    p.release(A.key, now=1.05)
    p.request(B.key, 0, now=1.06)
    p.release(B.key, now=1.08)
    assert p.request(B.key, 1, now=1.09) == []  # A (iteration 1) is owner, in its allreduce
    assert p.leave(A.key, now=1.10) == [B.key]


def test_holder_leaving_passes_the_device_on():
    p = joined(A, B)
    p.request(A.key, 0, now=1.0)
    p.request(B.key, 0, now=1.01)
    assert p.leave(A.key, now=1.02) == [B.key]


def test_three_jobs_take_turns_in_iteration_then_id_order():
    p = joined(A, B, C)
    for k in (C.key, A.key, B.key):
        p.request(k, 0, now=1.0)
    served = []
    now = 1.0
    for it in range(1, 4):
        for _ in range(3):
            holder = p.view(0).holders[0]
            served.append(holder.job_id)
            now += 0.01
            p.release(holder, now)
            p.request(holder, it, now + 0.001)
    # Everyone starts at iteration 0: ties go by id, on every node alike, whoever asked first.
    assert "".join(served) == "abc" * 3


def test_devices_are_decided_independently():
    a1, b1 = ref("a", 1, device=1), ref("b", 1, device=1)
    p = joined(A, B, a1, b1)
    for k in (A.key, B.key, a1.key, b1.key):
        p.request(k, 0, now=1.0)
    assert p.view(0).holders == (A.key,) and p.view(1).holders == (a1.key,)
    assert p.release(A.key, now=1.01) == [B.key]
    assert p.view(1).holders == (a1.key,)


def test_observe_ignores_unknown_jobs_and_nonpositive_durations():
    p = joined(A)
    p.observe(RankKey("ghost", 0), "comm", 1.0, now=1.0)
    p.observe(A.key, "comm", 0.0, now=1.0)
    p.observe(A.key, "compute", -1.0, now=1.0)
    assert p.request(A.key, 0, now=1.1) == [A.key]



# ---- the tie-break: job id (synchronized) or local join order -----------------------------


def _r(job: str, rank: int) -> RankRef:
    return RankRef(RankKey(job, rank), job, 0, 2, 0.0)


def test_nosync_orders_jobs_by_local_join_order():
    node0, node1 = TurnsPolicy(NOSYNC), TurnsPolicy(NOSYNC)
    for j in "abc":
        node0.join(_r(j, 0), 0.0)
    for j in "cab":
        node1.join(_r(j, 1), 0.0)
    assert node0.view(0).order == ("a", "b", "c")
    assert node1.view(0).order == ("c", "a", "b")
    node1.request(RankKey("c", 1), 0, 1.0)
    node1.release(RankKey("c", 1), 1.1)
    assert node1.view(0).order == ("a", "b", "c")  # cyclic after c: a
    node1.leave(RankKey("a", 1), 1.2)
    assert node1.view(0).order == ("b", "c")
    node1.join(_r("a", 1), 1.3)  # a re-joins: now the last to have joined this node
    assert node1.view(0).order == ("b", "a", "c")  # its cycle is now c -> b -> a; b's turn
    assert TurnsPolicy().name == "turns" and TurnsPolicy(NOSYNC).name == "turns-nosync"


def test_the_default_tie_break_is_the_job_id_whatever_order_the_jobs_joined():
    assert S.tiebreak == "job_id"
    node0, node1 = TurnsPolicy(), TurnsPolicy()
    for j in "bca":
        node0.join(_r(j, 0), 0.0)
    for j in "cab":
        node1.join(_r(j, 1), 0.0)
    assert node0.view(0).order == node1.view(0).order == ("a", "b", "c")
    node1.leave(RankKey("a", 1), 1.0)
    node1.join(_r("a", 1), 1.1)  # a re-joins: still first among jobs at the same turn
    assert node1.view(0).order == ("a", "b", "c")


def test_an_unknown_tie_break_is_refused():
    with pytest.raises(ValueError, match="tiebreak"):
        TurnsSettings(tiebreak="arrival")  # type: ignore[arg-type]
