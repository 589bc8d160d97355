"""The scheduler core: yields, overdue holders, random event sequences and heartbeats."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.daemon.api import FailedPrecondition, InvalidRequest, Phase
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.messages import AliveMsg, GrantMsg
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.event_records import Overdue, Release
from testbed.harness.oracles import compute_intervals, overlaps
from tests.unit.daemon.scheduler._world import _KINDS, FakeClock, drain_outbox, event, ident, join

# ---- yields and overdue holders ----------------------------------------


def test_a_yield_frees_the_device_and_the_pieces_count_as_one_compute_phase(make, clock):
    s = make("exclusive")
    a, box_a = join(s, job="job-a", device=0)
    b, box_b = join(s, job="job-b", device=0)
    event(s, a, "compute_request", iteration=3, seq=1)
    clock.advance(0.010)
    event(s, a, "compute_done", iteration=3, duration_s=0.010, yields=True)  # a metric allreduce begins
    event(s, b, "compute_request", iteration=0, seq=1)
    assert [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "the yielded device went to nobody"
    event(s, a, "compute_request", iteration=3, seq=2)  # back from the collective: same iteration
    event(s, b, "compute_done", iteration=0, duration_s=0.002, comm_begins=True)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)] == [1, 2]
    clock.advance(0.030)
    event(s, a, "compute_done", iteration=3, duration_s=0.030, comm_begins=True)
    rank = next(r for r in s.steering.snapshot()[1] if r.ident.job_id == "job-a")
    assert rank.iteration == 3
    assert rank.mean_compute_s == pytest.approx(0.040)  # both pieces, one phase
    assert s._state.sessions[a].stats.compute_n == 1 and s._state.sessions[a].stats.compute_ema == pytest.approx(0.040)
    yields = [e for e in s.events.events() if e.name is Release.name and Release.of(e).yields]
    assert len(yields) == 1


def test_a_holder_far_past_its_compute_time_is_overdue_and_the_next_rank_is_served(make, clock):
    s = make("exclusive", evict_after=100.0, timeout=100.0)
    s.liveness.overdue_factor, s.liveness.overdue_after_s = 10.0, 1.0
    a, box_a = join(s, job="job-a", device=0)
    b, box_b = join(s, job="job-b", device=0)
    for it in range(3):  # a measured compute time of 50 ms
        event(s, a, "compute_request", iteration=it, seq=it + 1)
        clock.advance(0.05)
        event(s, a, "compute_done", iteration=it, duration_s=0.05, comm_begins=True)
    event(s, a, "compute_request", iteration=3, seq=4)  # then it blocks somewhere while holding
    event(s, b, "compute_request", iteration=0, seq=1)
    clock.advance(0.9)
    s.reap()
    assert not [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "served before the floor"
    clock.advance(0.2)
    s.reap()
    assert [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "the overdue holder kept the device"
    assert s.liveness.overdue_total == 1
    per_dev, _ = s.steering.snapshot()
    assert [r.phase for r in per_dev[0].others] == [Phase.OVERDUE]
    assert [e.name for e in s.events.events()].count("overdue") == 1
    event(s, a, "compute_done", iteration=3, duration_s=1.2, comm_begins=True)  # its late end is no error
    event(s, b, "compute_done", iteration=0, duration_s=0.01, comm_begins=True)
    event(s, a, "compute_request", iteration=4, seq=5)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)][-1] == 5
    assert overlaps(compute_intervals(s.events.snapshot())[0]) == []


def test_a_first_phase_gets_the_warmup_limit_not_the_floor(make, clock):
    """A first step (no measured compute time yet) pays for lazy initialisation: held past
    `overdue_after_s` it is not yet stalled; past `overdue_warmup_s` it is."""
    s = make("exclusive", evict_after=100.0, timeout=100.0)
    s.liveness.overdue_after_s, s.liveness.overdue_warmup_s = 1.0, 5.0
    a, _ = join(s, job="job-a", device=0)
    b, box_b = join(s, job="job-b", device=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    event(s, b, "compute_request", iteration=0, seq=1)
    clock.advance(4.0)
    s.reap()
    assert s.liveness.overdue_total == 0 and not [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)]
    clock.advance(1.5)
    s.reap()
    assert s.liveness.overdue_total == 1 and [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)]


def test_a_long_holder_nobody_waits_for_is_left_alone(make, clock):
    s = make("exclusive", evict_after=100.0, timeout=100.0)
    s.liveness.overdue_after_s = 1.0
    a, _ = join(s, job="job-a", device=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(30.0)
    s.reap()
    assert s.liveness.overdue_total == 0


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["exclusive", "crossover"]), lease=st.booleans(),
       ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(_KINDS), st.integers(0, 3), st.booleans()),
                    max_size=60))
def test_whatever_ranks_send_a_blocking_policy_never_has_two_holders(policy, lease, ops):
    """The daemon enforces its own invariant: a rank that claims to compute without a grant
    (`no_wait`) and holds no lease is queued like any other request, never made a second holder."""
    clock = FakeClock()
    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    settings = SchedulerSettings(policy=policy, node="n", heartbeat_interval_s=0.1, lease=lease, adapt=False,
                                 liveness=LivenessSettings(heartbeat_timeout_s=5.0, evict_after_s=10.0))
    s = Scheduler(inv, settings, event_log=EventLog(clock=clock), clock=clock, pid_alive=lambda pid: True)
    try:
        sids = [s.register(ident(job=f"j{i}", rank=0, world=1, device=0), accepts_leases=True).session_id
                for i in range(3)]
        for sid in sids:
            s.attach(sid)
        for who, kind, iteration, yields in ops:
            clock.advance(0.01)
            try:
                if kind == "compute_request_no_wait":
                    event(s, sids[who], "compute_request", iteration=iteration, seq=iteration + 1, no_wait=True)
                elif kind == "compute_done_requested":
                    event(s, sids[who], "compute_done", iteration=iteration, seq=iteration + 1, requested=True,
                            duration_s=0.005, yields=yields)
                elif kind == "compute_done":
                    event(s, sids[who], "compute_done", iteration=iteration, yields=yields)
                else:
                    event(s, sids[who], kind, iteration=iteration, seq=iteration + 1)
            except (FailedPrecondition, InvalidRequest):
                pass
            holders = s.steering.snapshot()[0][0].holders
            assert len(holders) <= 1, f"two holders after {kind} from session {who}: {holders}"
    finally:
        s.shutdown()


def test_every_heartbeat_is_answered_so_a_rank_can_tell_a_frozen_daemon(make):
    s = make()
    a, box = join(s)
    drain_outbox(box)
    event(s, a, "heartbeat")
    event(s, a, "heartbeat")
    answers = []
    while not box.empty():
        answers.append(box.get_nowait())
    assert [type(m) for m in answers] == [AliveMsg, AliveMsg]


# ---- the daemon's clock decides ------------------------------------------


def test_a_holders_own_long_figure_does_not_lengthen_its_limit(make, clock):
    """A rank that reports a day-long compute phase it was seen to hold for 10 ms is measured at
    10 ms: its next hold, with a rank waiting, is overdue at the floor, not at ten days."""
    s = make("exclusive", evict_after=1000.0, timeout=1000.0)
    s.liveness.overdue_factor, s.liveness.overdue_after_s = 10.0, 1.0
    a, _ = join(s, job="hog", device=0)
    b, box_b = join(s, job="victim", device=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(0.01)
    event(s, a, "compute_done", iteration=0, duration_s=86_400.0, comm_begins=True)
    assert s._state.sessions[a].stats.compute_ema == pytest.approx(0.01)
    event(s, a, "compute_request", iteration=1, seq=2)
    event(s, b, "compute_request", iteration=0, seq=1)
    clock.advance(1.1)
    s.reap()
    assert s.liveness.overdue_total == 1 and [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)]


def test_no_holder_keeps_a_waited_for_device_past_max_hold(make, clock):
    s = make("exclusive", evict_after=1000.0, timeout=1000.0)
    s.liveness.overdue_factor, s.liveness.overdue_after_s, s.liveness.max_hold_s = 10.0, 1.0, 60.0
    a, _ = join(s, job="slow", device=0)
    b, box_b = join(s, job="victim", device=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(50.0)  # a genuinely long phase: its limit would be 500 s
    event(s, a, "compute_done", iteration=0, duration_s=50.0, comm_begins=True)
    event(s, a, "compute_request", iteration=1, seq=2)
    event(s, b, "compute_request", iteration=0, seq=1)
    clock.advance(59.0)
    s.reap()
    assert s.liveness.overdue_total == 0
    clock.advance(2.0)
    s.reap()
    assert s.liveness.overdue_total == 1 and [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)]
    overdue = [Overdue.of(e) for e in s.events.events() if e.name is Overdue.name]
    assert overdue[0].limit_s == pytest.approx(60.0)


def test_a_backdated_request_cannot_jump_the_queue(make, clock):
    """`ago_s` dates an event inside a batch; it cannot date it before the rank's previous message."""
    s = make("exclusive", evict_after=1000.0, timeout=1000.0)
    holder, _ = join(s, job="holder", device=0)
    honest, box_h = join(s, job="honest", device=0)
    cheat, box_c = join(s, job="cheat", device=0)
    event(s, holder, "compute_request", iteration=0, seq=1)
    event(s, cheat, "heartbeat")
    clock.advance(1.0)
    event(s, honest, "compute_request", iteration=0, seq=1)
    clock.advance(0.5)
    event(s, cheat, "compute_request", iteration=0, seq=1, ago_s=100.0)  # "asked long ago"
    requests = [e for e in s.events.events() if e.name == "request" and e.job == "cheat"]
    assert requests[0].t == clock()  # a request that waits is dated when it arrived
    event(s, holder, "compute_done", iteration=0, duration_s=0.1, comm_begins=True)
    assert [m for m in drain_outbox(box_h) if isinstance(m, GrantMsg)]
    assert not [m for m in drain_outbox(box_c) if isinstance(m, GrantMsg)]
