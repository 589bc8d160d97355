"""The scheduler core: policy switches, drains, snapshots and the event log's dating and order."""
from __future__ import annotations

import itertools
import threading
import time

import pytest

from crossover.daemon.api import FailedPrecondition, InvalidRequest, NotFound, Phase
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.messages import GrantMsg, PolicyMsg
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.event_records import CommEnd, Drain, DrainRefused, Grant, Policy, Release
from testbed.harness.oracles import compute_intervals, overlaps
from tests.unit.daemon.scheduler._world import _phase, drain_outbox, event, holders_over_time, ident, join

# ---- operator side -----------------------------------------------------


def test_set_policy_requeues_and_announces(make):
    s = make("exclusive")
    a, box_a = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    idle, box_idle = join(s, job="job-c", rank=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=2)
    drain_outbox(box_a)
    assert s.steering.set_policy("passthrough") == "passthrough"
    assert s.steering.policy_name == "passthrough"
    assert drain_outbox(box_a) == [PolicyMsg("passthrough", False)]  # no second grant for the holder
    # b was waiting: the policy update alone frees it (passthrough sends no grants; nobody waits for them)
    assert drain_outbox(box_b) == [PolicyMsg("passthrough", False)]
    assert drain_outbox(box_idle) == [PolicyMsg("passthrough", False)]
    per_dev, _ = s.steering.snapshot()
    assert {r.ident.rank for r in per_dev[0][0]} == {0, 1}
    # both finish normally under the new policy
    event(s, a, "compute_done")
    event(s, b, "compute_done")
    assert [Policy.of(e).new for e in s.events.events() if e.name is Policy.name] == ["passthrough"]


def test_passthrough_records_grants_but_sends_none(make):
    s = make("passthrough")
    a, box_a = join(s, rank=0)
    for i in range(3):
        event(s, a, "compute_request", iteration=i, seq=i + 1)
        event(s, a, "compute_done", iteration=i, comm_begins=True)
    assert drain_outbox(box_a) == []
    assert [e.name for e in s.events.events() if e.rank == 0].count("grant") == 3


def test_a_compute_done_can_stand_for_its_request_too_and_is_dated_back(make, clock):
    """A rank that does not wait sends one message per iteration: the request rides on the release."""
    s = make("passthrough")
    a, box = join(s, rank=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(0.03)
    event(s, a, "compute_done", iteration=0, comm_begins=True)
    t0 = clock.t
    clock.advance(0.5)
    event(s, a, "compute_done", iteration=1, seq=2, duration_s=0.1, requested=True, comm_s=0.4, comm_begins=True)
    log = [e for e in s.events.events() if e.job == "job-a"][-5:]
    assert [e.name for e in log] == ["comm_end", "request", "grant", "release", "comm_begin"]
    assert [e.t - t0 for e in log] == pytest.approx([0.4, 0.4, 0.4, 0.5, 0.5])
    assert CommEnd.of(log[0]).duration_s == 0.4 and Release.of(log[3]).held_s == pytest.approx(0.1)
    rank = s.steering.snapshot()[1][0]
    assert (rank.iteration, rank.phase, rank.mean_comm_s) == (1, Phase.COMM, pytest.approx(0.4))
    assert rank.mean_compute_s == pytest.approx((0.03 + 0.1) / 2)
    assert drain_outbox(box) == []
    with pytest.raises(InvalidRequest, match="comm_s"):
        event(s, a, "compute_done", requested=True, comm_s=-1.0)


def test_a_rank_s_dated_events_never_fall_before_its_previous_one(make, clock):
    # Two batches, the first slow on the wire (0.8 ms) and the next fast (0.1 ms): dated by
    # arrival less age, iteration 1's start (0.4 ms after iteration 0 ended) would land before
    # that end, and the rank's own compute phases would overlap in the log.
    s = make("passthrough")
    a, _ = join(s, rank=0)
    event(s, a, "compute_done", iteration=0, seq=1, duration_s=0.004, requested=True, comm_begins=True)
    end0 = clock.t
    clock.advance(0.0044 - 0.0008 + 0.0001)  # iteration 1 ran 0.4 ms after it for 4 ms, then a faster batch
    event(s, a, "compute_done", iteration=1, seq=2, duration_s=0.004, requested=True, comm_s=0.0003,
            comm_begins=True, ago_s=0.0001)
    log = [e for e in s.events.events() if e.job == "job-a"]
    grants = [e.t for e in log if e.name == "grant"]
    releases = [e.t for e in log if e.name == "release"]
    assert releases[0] == pytest.approx(end0)
    assert grants[1] >= releases[0]  # without the clamp: 0.3 ms before it
    assert all(b.t >= a_.t for a_, b in zip(log, log[1:]))


def test_one_decision_is_logged_at_one_instant_so_a_rank_s_phases_never_overlap(clock, pids):
    # The log's own clock reads a little later than the decision it records (it runs after the
    # scheduler's work). A phase logged that late could end after its rank's next phase began,
    # when that next phase is dated back from its report (here the log reads 17 us late).
    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    s = Scheduler(inv, SchedulerSettings(policy="passthrough", node="node-t", adapt=False),
                  event_log=EventLog(clock=lambda: clock.t + 17e-6), clock=clock, pid_alive=pids)
    try:
        a, _ = join(s, rank=0)
        event(s, a, "compute_done", iteration=0, seq=1, duration_s=0.004, requested=True, comm_begins=True)
        clock.advance(0.0044)  # the next phase began 5 us after that one ended
        event(s, a, "compute_done", iteration=1, seq=2, duration_s=0.0044 - 5e-6, requested=True,
                comm_s=0.0003, comm_begins=True)
        log = [e for e in s.events.events() if e.job == "job-a"]
        assert overlaps([iv for ivs in compute_intervals(log).values() for iv in ivs]) == []
        assert all(b.t >= a_.t for a_, b in zip(log, log[1:]))
    finally:
        s.shutdown()


def test_decisions_are_logged_in_the_order_they_are_made_even_when_a_thread_is_preempted(pids):
    # Thread X reads the clock for its event and is preempted for a while; thread Y's
    # event meanwhile is decided and logged. X's decision comes after Y's, so it must not
    # be dated before it.
    ticks = itertools.count()
    stall = {"thread": None, "until": threading.Event()}

    def clock() -> float:
        t = 1000.0 + 0.001 * next(ticks)
        if threading.current_thread() is stall["thread"]:
            stall["thread"] = None
            stall["until"].wait(0.5)  # under the lock Y cannot run: the wait just times out
        return t

    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    s = Scheduler(inv, SchedulerSettings(policy="exclusive", node="node-t", adapt=False),
                  event_log=EventLog(clock=clock), clock=clock, pid_alive=pids)
    try:
        a, _ = join(s, job="job-a", rank=0, leases=False)
        b, _ = join(s, job="job-b", rank=0, leases=False)
        event(s, a, "compute_request", iteration=0, seq=1)

        def x() -> None:
            event(s, a, "compute_done", iteration=0, comm_begins=True)

        def y() -> None:
            event(s, b, "compute_request", iteration=0, seq=1)
            stall["until"].set()

        tx = threading.Thread(target=x)
        stall["thread"] = tx
        tx.start()
        while stall["thread"] is not None:  # X has read the clock
            time.sleep(0.001)
        ty = threading.Thread(target=y)
        ty.start()
        tx.join(5)
        ty.join(5)
        times = [e.t for e in s.events.events()]
        assert times == sorted(times)
    finally:
        s.shutdown()


def test_compute_done_can_begin_the_allreduce_in_the_same_message(make, clock):
    s = make("exclusive")
    a, box_a = join(s, rank=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(0.1)
    event(s, a, "compute_done", iteration=0, comm_begins=True)
    assert _phase(s, a) is Phase.COMM
    clock.advance(0.3)
    event(s, a, "compute_request", iteration=1, seq=2)  # ends the comm the done began
    rank = s.steering.snapshot()[1][0]
    assert rank.mean_compute_s == pytest.approx(0.1) and rank.mean_comm_s == pytest.approx(0.3)
    assert [e.name for e in s.events.events() if e.rank == 0][-5:] == [
        "release", "comm_begin", "comm_end", "request", "grant"]


def test_set_policy_requeues_waiting_ranks_and_grants_one_when_the_device_frees(make):
    s = make("exclusive")
    c, box_c = join(s, job="job-c", rank=0, world=1)
    a, box_a = join(s, job="job-a", rank=0, world=1)
    b, box_b = join(s, job="job-b", rank=0, world=1)
    event(s, c, "compute_request", iteration=0, seq=1)  # c holds; a and b wait
    event(s, a, "compute_request", iteration=5, seq=1)
    event(s, b, "compute_request", iteration=1, seq=1)
    s.steering.set_policy("crossover")
    s.close(c, "stream ended")
    # requeued at one moment: crossover's tie rule (job id) picks a, the same on every node
    assert [type(m) for m in drain_outbox(box_a)] == [PolicyMsg, GrantMsg]
    assert [type(m) for m in drain_outbox(box_b)] == [PolicyMsg]


def test_set_policy_keeps_a_computing_rank_on_its_device_whatever_its_turn(make):
    s = make("exclusive")
    z, box_z = join(s, job="job-z", rank=0, world=1)
    a, box_a = join(s, job="job-a", rank=0, world=1)
    event(s, z, "compute_request", iteration=3, seq=1)  # z computes at turn 3
    event(s, a, "compute_request", iteration=0, seq=1)  # a waits at turn 0: first in crossover's order
    s.steering.set_policy("crossover")
    assert drain_outbox(box_a) == [PolicyMsg("crossover", True)]  # not granted beside z
    event(s, z, "compute_done", iteration=3, comm_begins=True)
    assert [type(m) for m in drain_outbox(box_a)] == [GrantMsg]
    assert holders_over_time(s) == 1


def test_set_policy_back_to_exclusive_leaves_no_ghost_request(make):
    """Two ranks computing under passthrough; after a switch to exclusive the second is
    queued behind the first. When it reports compute_done it must leave that queue, or a
    stale grant would later mark it as computing and refuse its next request."""
    s = make("passthrough")
    a, box_a = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    s.steering.set_policy("exclusive")
    event(s, b, "compute_done")
    event(s, a, "compute_done")
    drain_outbox(box_a), drain_outbox(box_b)
    per_dev, _ = s.steering.snapshot()
    assert per_dev[0][0] == [] and per_dev[0][1] == []
    event(s, b, "comm_begin")
    event(s, b, "comm_end", duration_s=0.01)
    event(s, b, "compute_request", seq=2)  # must not raise
    assert [m.seq for m in drain_outbox(box_b)] == [2]
    event(s, a, "compute_request", seq=2)
    assert drain_outbox(box_a) == []  # exclusive again: a waits for b
    event(s, b, "compute_done")
    assert [m.seq for m in drain_outbox(box_a)] == [2]


def test_set_policy_unknown_keeps_the_old_one(make):
    s = make("exclusive")
    with pytest.raises(NotFound, match="choose one of"):
        s.steering.set_policy("bogus")
    assert s.steering.policy_name == "exclusive"


def test_drain_refuses_new_ranks_and_resume_accepts_them(make):
    s = make(n_devices=2)
    s.register(ident(job="before", device=0))
    assert s.steering.drain(0, True) is True
    assert s.steering.is_draining(0) and not s.steering.is_draining(1)
    with pytest.raises(FailedPrecondition, match="drained"):
        s.register(ident(job="during", device=0))
    s.register(ident(job="other-device", device=1))
    assert s.steering.drain(0, False) is False
    assert not s.steering.is_draining(0)
    s.register(ident(job="during", device=0))
    with pytest.raises(InvalidRequest, match="does not exist"):
        s.steering.drain(5, True)
    assert [e.name for e in s.events.events() if e.name in ("drain", "resume")] == ["drain", "resume"]


def test_snapshot_shows_holder_waiting_order_and_stats(make, clock):
    s = make()
    a, _ = join(s, rank=0)
    b, _ = join(s, job="job-b", rank=1)
    c, _ = join(s, job="job-c", rank=0)
    idle, _ = join(s, job="job-d", rank=0)
    other_dev, _ = join(s, job="job-e", rank=0, device=1)
    event(s, a, "compute_request", iteration=0, seq=1)
    clock.advance(0.1)
    event(s, a, "compute_done", iteration=0)
    event(s, a, "comm_begin", iteration=0)
    clock.advance(0.3)
    event(s, a, "comm_end", iteration=0)
    event(s, a, "compute_request", iteration=1, seq=2)
    event(s, c, "compute_request", iteration=5, seq=1)
    event(s, b, "compute_request", iteration=1, seq=1)
    clock.advance(0.2)
    per_dev, ranks = s.steering.snapshot()
    holders, waiting, others, order = per_dev[0]
    assert [(r.ident.job_id, r.ident.rank) for r in holders] == [("job-a", 0)]
    assert [(r.ident.job_id, r.ident.rank) for r in waiting] == [("job-c", 0), ("job-b", 1)]
    assert [r.ident.job_id for r in others] == ["job-d"]
    assert order == ()
    h = holders[0]
    assert h.phase is Phase.COMPUTE and h.iteration == 1
    assert h.mean_compute_s == pytest.approx(0.1)
    assert h.mean_comm_s == pytest.approx(0.3)
    assert h.since_s == pytest.approx(0.2)
    assert h.ident.node == "node-t" and h.ident.device == 0
    assert waiting[0].phase is Phase.WAITING and waiting[0].iteration == 5
    assert 0 < waiting[0].wait_fraction <= 1
    assert others[0].phase is Phase.IDLE
    assert [r.ident.job_id for r in per_dev[1][2]] == ["job-e"]
    assert len(ranks) == 5


def test_event_log_records_grants_and_releases_with_device(make, clock):
    s = make()
    a, _ = join(s, rank=0, device=1)
    event(s, a, "compute_request", iteration=2, seq=1)
    clock.advance(0.05)
    event(s, a, "compute_done", iteration=2)
    log = [e for e in s.events.events() if e.job == "job-a"]
    assert [e.name for e in log] == ["register", "request", "grant", "release"]
    grant, release = log[2], log[3]
    assert grant.device == 1 and release.device == 1
    assert grant.node == "node-t" and grant.rank == 0 and grant.job_name == "name-job-a"
    assert Grant.of(grant) == Grant(iteration=2, waited_s=0.0)
    assert release.t - grant.t == pytest.approx(0.05)
    assert Release.of(release).held_s == pytest.approx(0.05)


def test_uptime_follows_the_clock(make, clock):
    s = make()
    clock.advance(12.5)
    assert s.steering.uptime() == pytest.approx(12.5)


def test_a_new_cpu_rank_goes_around_a_drained_device_and_a_gpu_rank_is_refused_plainly(make, pids):
    s = make(n_devices=3)
    s.steering.drain(0, True, caller="admin socket, user ops (as the client says)")
    assert s.register(ident(job="a", rank=0, world=1, local_rank=0, device=-1)).device == 1  # fewest ranks
    s.steering.drain(1, True)
    s.steering.drain(2, True)
    with pytest.raises(FailedPrecondition, match="drained by this node's operator.*trains on it unscheduled"):
        s.register(ident(job="b", rank=0, world=1, local_rank=0, device=-1))
    assert s.steering.drain_refusals(0) == 1 and s.steering.drain_refusals(1) == 0
    refused = [DrainRefused.of(e) for e in s.events.events() if e.name is DrainRefused.name]
    assert refused == [DrainRefused(device=0, job="b", job_name="name-b", rank_refused=0)]
    drains = [Drain.of(e) for e in s.events.events() if e.name is Drain.name]
    assert drains[0].caller == "admin socket, user ops (as the client says)"
    s.steering.drain(0, False)
    assert s.steering.drain_refusals(0) == 0  # a resume starts the count again

    gpus = Scheduler(Inventory([Device(0, "gpu", "gpu0", ()), Device(1, "gpu", "gpu1", ())]),
                     SchedulerSettings(policy="exclusive", node="n", adapt=False), event_log=EventLog(), pid_alive=pids)
    gpus.steering.drain(0, True)
    with pytest.raises(FailedPrecondition, match="drained"):  # its script picks GPU 0 itself: no moving it
        gpus.register(ident(job="c", rank=0, world=1, local_rank=0, device=-1))


def test_set_policy_with_protect_restarts_the_policy_under_the_new_target(make):
    from crossover.daemon.policies.classes import Priority

    s = make("crossover", n_devices=1)
    a, _ = join(s, rank=0, world=1)
    b, _ = join(s, job="job-b", rank=0, world=1)
    s.ownership.set_job_class("job-b", Priority.LOW)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    assert s.steering.protect == 0.97 and s.steering.isolation(0) is not None  # the controller holds job-a at 0.97
    assert s.steering.set_policy("crossover", protect=0.0) == "crossover"
    event(s, a, "compute_done")
    event(s, a, "compute_request", seq=2)
    assert s.steering.protect == 0.0 and s.steering.isolation(0) is None  # off: the open-loop class rules alone
    s.steering.set_policy("passthrough")
    assert s.steering.protect == 0.0  # a later switch keeps the operator's target
    policies = [Policy.of(e) for e in s.events.events() if e.name is Policy.name]
    assert [(p.new, p.protect) for p in policies] == [("crossover", 0.0), ("passthrough", 0.0)]
