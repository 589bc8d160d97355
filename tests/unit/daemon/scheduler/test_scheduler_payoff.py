"""The scheduler opens a device where grants do not pay and closes it where they do (`grant_payoff`)."""
from __future__ import annotations

import pytest

from crossover.daemon.api import Phase
from crossover.daemon.event_log import EventLog
from crossover.daemon.grant_payoff import Mode, PayoffJudge, PayoffSettings, Verdict
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.messages import GrantMsg, LeaseMsg
from crossover.daemon.policies.classes import ClassSettings, Priority
from crossover.daemon.policies.isolation import IsolationSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.event_records import Adapt, Sharing
from tests.unit.daemon.scheduler._world import _phase, drain_outbox, event, join


class _Told(PayoffJudge):
    """A judge whose verdict the test sets (the rule itself is tested in tests/unit/daemon/test_grant_payoff.py)."""

    told: Verdict | None = None

    def sample(self, wall: float, progress: dict[str, int], scored: frozenset[str] | None = None) -> Verdict:
        self.verdict = self.told or self.verdict
        return self.verdict


def _scheduler(clock, pids) -> Scheduler:
    """A daemon whose classes are judged by the probe alone: `--protect 0` (the isolation controller, which holds
    grants where classes differ, is `test_isolation.py`'s)."""
    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    settings = SchedulerSettings(policy="crossover", node="node-t", heartbeat_interval_s=0.1, lease=True,
                                 liveness=LivenessSettings(heartbeat_timeout_s=5.0, evict_after_s=10.0),
                                 classes=ClassSettings(isolation=IsolationSettings(target=0)),
                                 payoff=PayoffSettings(window_s=1.0, settle_share=0.1))
    return Scheduler(inv, settings, event_log=EventLog(clock=clock), clock=clock, pid_alive=pids, wall=clock)


def test_an_open_device_leases_every_rank_and_grants_its_waiters_then_closes(clock, pids):
    s = _scheduler(clock, pids)
    judge = _Told(PayoffSettings())
    s.steering._judges[0] = judge  # noqa: SLF001 (the test decides the verdicts)
    a, box_a = join(s, job="job-a", rank=0)
    b, box_b = join(s, job="job-b", rank=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)  # b waits behind a
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0)] and drain_outbox(box_b) == []

    judge.told = Verdict(Mode.UNSCHEDULED, "grants do not pay: 0.80x the progress unscheduled", 0.8)
    s.steering.adapt()
    assert drain_outbox(box_a) == [LeaseMsg(True)]
    assert drain_outbox(box_b) == [LeaseMsg(True), GrantMsg(1, 0, 0.0)]  # b computes beside a at once
    assert _phase(s, a) is Phase.COMPUTE and _phase(s, b) is Phase.COMPUTE
    # leased ranks report without waiting; their requests are taken as they come
    event(s, a, "compute_done", comm_begins=True)
    event(s, a, "comm_end", duration_s=0.01)
    event(s, a, "compute_request", iteration=1, seq=2, no_wait=True)
    assert _phase(s, a) is Phase.COMPUTE and drain_outbox(box_a) == []
    sharing = [Sharing.of(e) for e in s.events.events() if e.name is Sharing.name]
    assert [(v.device, v.mode) for v in sharing] == [(0, "unscheduled")]
    assert s.steering.sharing(0).mode is Mode.UNSCHEDULED

    judge.told = Verdict(Mode.SCHEDULED, "grants pay: 1.10x the progress unscheduled", 1.1)
    s.steering.adapt()
    assert drain_outbox(box_a) == [LeaseMsg(False)] and drain_outbox(box_b) == [LeaseMsg(False)]
    event(s, a, "lease_released")
    event(s, b, "lease_released")
    event(s, a, "compute_done", iteration=1, comm_begins=True)
    event(s, b, "compute_done", comm_begins=True)
    event(s, b, "comm_end", duration_s=0.01)
    event(s, b, "compute_request", iteration=1, seq=2)  # grants again, one job at a time
    assert drain_outbox(box_b) == [GrantMsg(2, 1, 0.0)]
    event(s, a, "comm_end", duration_s=0.01)
    event(s, a, "compute_request", iteration=2, seq=3)
    assert drain_outbox(box_a) == []
    event(s, b, "compute_done", iteration=1, comm_begins=True)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)] == [3]


def test_without_payoff_settings_the_scheduler_never_opens_a_device(make):
    s = make("crossover", lease=True)
    a, box_a = join(s, job="job-a", rank=0)
    b, box_b = join(s, job="job-b", rank=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    s.steering.adapt()
    assert drain_outbox(box_b) == [] and s.steering.sharing(0) is None


def test_the_judge_counts_the_phases_each_jobs_furthest_rank_ended(clock, pids):
    s = _scheduler(clock, pids)
    seen: list[dict[str, int]] = []

    class Spy(PayoffJudge):
        def sample(self, wall: float, progress: dict[str, int], scored: frozenset[str] | None = None) -> Verdict:
            seen.append(dict(progress))
            return self.verdict

    s.steering._judges[0] = Spy(PayoffSettings())  # noqa: SLF001
    a0, _ = join(s, job="job-a", rank=0)
    join(s, job="job-a", rank=1)
    join(s, job="job-b", rank=0)
    for i in range(3):  # the compute phases the daemon saw end count, whatever iteration a rank claims
        event(s, a0, "compute_request", iteration=1000 * i, seq=i + 1)
        event(s, a0, "compute_done", iteration=1000 * i, comm_begins=True)
        event(s, a0, "comm_end", duration_s=0.01)
    s.steering.adapt()
    assert seen[-1] == {"job-a": 3, "job-b": 0}


def test_the_operator_switches_adapt_off_and_every_open_device_closes(clock, pids):
    s = _scheduler(clock, pids)
    judge = _Told(PayoffSettings())
    s.steering._judges[0] = judge  # noqa: SLF001
    a, box_a = join(s, job="job-a", rank=0)
    b, box_b = join(s, job="job-b", rank=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    judge.told = Verdict(Mode.UNSCHEDULED, "grants do not pay", 0.8)
    s.steering.adapt()
    drain_outbox(box_a), drain_outbox(box_b)
    assert s.steering.set_adapt(False, caller="test") is False and not s.steering.adapting
    assert drain_outbox(box_a) == [LeaseMsg(False)] and drain_outbox(box_b) == [LeaseMsg(False)]
    s.steering.adapt()  # off: no judge samples, nothing opens again
    assert drain_outbox(box_a) == [] and s.steering.sharing(0) is None
    assert [Adapt.of(e) for e in s.events.events() if e.name is Adapt.name] == [Adapt(on=False, caller="test")]
    assert s.steering.set_adapt(True) is True and s.steering.adapting and 0 not in s.steering._judges  # noqa: SLF001 (measured afresh)


def test_adapt_off_at_start_can_be_switched_on(make):
    s = make("crossover", lease=True)
    assert not s.steering.adapting
    s.steering.set_adapt(True)
    a, _ = join(s, job="job-a", rank=0)
    s.steering.adapt()
    assert s.steering.sharing(0) is not None


def test_where_classes_differ_only_the_highest_class_scores_and_its_weights_keep_grants(clock, pids):
    s = _scheduler(clock, pids)
    seen: list[frozenset[str] | None] = []
    held: list[str] = []

    class Spy(PayoffJudge):
        def sample(self, wall: float, progress: dict[str, int], scored: frozenset[str] | None = None) -> Verdict:
            seen.append(scored)
            return self.verdict

        def hold(self, verdict: Verdict) -> Verdict:
            held.append(verdict.reason)
            return super().hold(verdict)

    s.steering._judges[0] = Spy(PayoffSettings())  # noqa: SLF001
    for job in ("job-a", "job-b", "job-c"):
        join(s, job=job, rank=0)
    s.steering.adapt()
    assert seen[-1] is None  # one class: every job scores
    s.ownership.set_job_class("job-b", Priority.LOW)
    s.ownership.set_job_class("job-c", Priority.LOW)
    s.steering.adapt()
    assert seen[-1] == frozenset({"job-a"})  # the production job decides whether grants stay
    s.ownership.set_job_class("job-c", weight=2.0)
    s.steering.adapt()
    assert seen[-1] == frozenset({"job-a"}) and held == []  # the low jobs' weights do not keep grants
    s.ownership.set_job_class("job-a", Priority.HIGH)
    s.ownership.set_job_class("job-b", Priority.HIGH)
    s.steering.adapt()
    assert seen[-1] == frozenset({"job-a", "job-b"})
    n = len(seen)
    s.ownership.set_job_class("job-a", weight=3.0)
    s.steering.adapt()  # the highest class's weights are shares of the grants: no probe, grants stay
    assert len(seen) == n and held == ["its jobs differ in weight"]
    assert s.steering.sharing(0).mode is Mode.SCHEDULED and "weight" in s.steering.sharing(0).reason


def test_phases_on_an_open_device_do_not_feed_the_estimates_that_fit_a_lower_job_into_gaps(clock, pids):
    """A probe's unscheduled windows stretch every job's phases (they run beside each other); a low job's
    compute measured there would not fit the production job's gaps under grants, and the low job would get
    only its guard until eight phases of its own replaced them."""
    s = _scheduler(clock, pids)
    judge = _Told(PayoffSettings())
    s.steering._judges[0] = judge  # noqa: SLF001
    a, box_a = join(s, job="job-a", rank=0)
    b, box_b = join(s, job="job-b", rank=0)
    s.ownership.set_job_class("job-b", Priority.LOW)
    book = s._state.phases.policy.book  # noqa: SLF001 (the estimates under test)
    judge.told = Verdict(Mode.UNSCHEDULED, "grants do not pay the highest class", 0.9)
    s.steering.adapt()
    drain_outbox(box_a), drain_outbox(box_b)
    for it in range(3):
        for sid in (a, b):
            event(s, sid, "compute_request", iteration=it, seq=it + 1, no_wait=True)
        clock.advance(0.45)  # three times a phase under grants
        for sid in (a, b):
            event(s, sid, "compute_done", iteration=it, comm_begins=True)
        clock.advance(0.3)
        for sid in (a, b):
            event(s, sid, "comm_end", duration_s=0.3)
    assert book.long_phase("job-b") is None and book.short_gap("job-a") is None
    # Phases begun on the open device and ended after it closed are not counted either.
    event(s, b, "compute_request", iteration=3, seq=4, no_wait=True)
    event(s, a, "compute_request", iteration=3, seq=4, no_wait=True)
    clock.advance(0.15)
    event(s, a, "compute_done", iteration=3, comm_begins=True)
    clock.advance(0.01)
    judge.told = Verdict(Mode.SCHEDULED, "grants pay the highest class", 1.2)
    s.steering.adapt()
    clock.advance(0.3)
    event(s, b, "compute_done", iteration=3, comm_begins=True)
    event(s, a, "comm_end", duration_s=0.3)
    event(s, b, "lease_released")
    event(s, a, "lease_released")
    assert book.long_phase("job-b") is None and book.short_gap("job-a") is None
    clock.advance(0.3)
    event(s, b, "comm_end", duration_s=0.3)
    event(s, b, "compute_request", iteration=4, seq=5)
    clock.advance(0.15)
    event(s, b, "compute_done", iteration=4, comm_begins=True)
    event(s, a, "compute_request", iteration=4, seq=5)
    clock.advance(0.15)
    event(s, a, "compute_done", iteration=4, comm_begins=True)
    clock.advance(0.2)
    event(s, a, "comm_end", duration_s=0.2)
    assert book.long_phase("job-b") == pytest.approx(0.15) and book.short_gap("job-a") == pytest.approx(0.2)
