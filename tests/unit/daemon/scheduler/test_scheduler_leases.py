"""The scheduler core: leases to ranks alone on their device, and their revocation."""
from __future__ import annotations

import pytest

from crossover.daemon.messages import GrantMsg, LeaseMsg, PolicyMsg
from crossover.protos.event_records import LeaseRevoke
from tests.unit.daemon.scheduler._world import drain_outbox, event, holders_over_time, join, leased

# ---- leases --------------------------------------------------------------


def test_a_lone_rank_is_leased_and_then_not_sent_grants(make):
    s = make(lease=True)
    a, box = join(s, rank=0)
    event(s, a, "compute_request", iteration=0, seq=1)
    assert drain_outbox(box) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    event(s, a, "compute_done", iteration=0, comm_begins=True)
    for i in (1, 2):
        event(s, a, "compute_request", iteration=i, seq=i + 1, no_wait=True)
        event(s, a, "compute_done", iteration=i, comm_begins=True)
    assert drain_outbox(box) == []  # the rank did not wait, so nothing is sent
    # a request made before the rank read its lease is still answered: it is waiting for that grant
    event(s, a, "compute_request", iteration=3, seq=4)
    assert drain_outbox(box) == [GrantMsg(4, 3, 0.0)]
    log = [e.name for e in s.events.events()]
    assert log.count("grant") == 4 and log.count("release") == 3 and log.count("lease") == 1


def test_no_lease_when_the_device_is_shared_or_leases_are_off(make):
    s = make(lease=True)
    a, box_a = join(s, rank=0, device=0)
    join(s, job="job-b", rank=0, device=0)
    event(s, a, "compute_request", seq=1)
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0)]
    off = make(lease=False)
    b, box_b = join(off, job="solo", world=1, rank=0)
    event(off, b, "compute_request", seq=1)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    old_client = make(lease=True)
    c, box_c = join(old_client, leases=False, job="solo", world=1, rank=0)
    event(old_client, c, "compute_request", seq=1)
    assert drain_outbox(box_c) == [GrantMsg(1, 0, 0.0)]


def test_a_job_alone_on_its_device_leases_it_to_each_of_its_ranks(make):
    s = make(lease=True)
    a, box_a = join(s, rank=0, device=0)
    b, box_b = join(s, rank=1, device=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    join(s, job="job-c", rank=0, device=0)  # another job arrives: both leases are taken back
    assert drain_outbox(box_a) == [LeaseMsg(False)] and drain_outbox(box_b) == [LeaseMsg(False)]


def test_passthrough_leases_nothing(make):
    s = make("passthrough", lease=True)
    a, box = join(s, rank=0)
    event(s, a, "compute_request", seq=1)
    assert drain_outbox(box) == []


def test_a_newcomer_waits_for_the_holders_requests_in_flight(make):
    """The hazard: the holder computes under its lease while its request is still on the wire.

    The newcomer's request must not reach the policy before the holder's
    LEASE_RELEASED, which follows that request on the holder's stream.
    """
    s = make(lease=True)
    a, box_a = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    assert drain_outbox(box_a) == [LeaseMsg(False)]
    event(s, b, "compute_request", iteration=0, seq=1)
    assert drain_outbox(box_b) == []  # held back although the daemon has not seen the holder compute
    assert [r.ident.job_id for r in s.steering.snapshot()[0][0].waiting] == ["new"]
    event(s, a, "compute_request", iteration=1, seq=2, no_wait=True)  # before the holder saw the revoke
    event(s, a, "lease_released")
    assert drain_outbox(box_b) == []  # queued behind the holder now
    event(s, a, "compute_done", iteration=1, comm_begins=True)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1
    # from now on the holder waits like everyone else
    event(s, a, "compute_request", iteration=2, seq=3)
    assert drain_outbox(box_a) == []
    event(s, b, "compute_done", iteration=0)
    assert drain_outbox(box_a) == [GrantMsg(3, 2, 0.0)]
    events = [e.name for e in s.events.events()]
    assert events.count("lease_revoke") == 1 and events.count("lease_released") == 1


def test_a_holder_computing_at_the_hand_over_keeps_the_device_under_crossover(make):
    """The holder's request in flight says it computes already: it holds the device at once.

    Under `crossover` the newcomer is first in order (it asked first), so a plain request from the
    holder would be queued behind it, and the newcomer granted at LEASE_RELEASED while
    the holder still computes.
    """
    s = make(policy="crossover", lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    event(s, b, "compute_request", iteration=0, seq=1)
    event(s, a, "compute_request", iteration=1, seq=2, no_wait=True)
    event(s, a, "lease_released")
    assert drain_outbox(box_b) == []
    assert [r.ident.job_id for r in s.steering.snapshot()[0][0].holders] == ["old"]
    event(s, a, "compute_done", iteration=1, comm_begins=True)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1


def test_the_newcomer_is_granted_at_the_release_when_the_holder_was_idle(make):
    s = make(lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    event(s, b, "compute_request", seq=7)
    event(s, a, "lease_released")
    assert drain_outbox(box_b) == [GrantMsg(7, 0, 0.0)]


@pytest.mark.parametrize("end", ["close", "suspend"])
def test_a_holder_that_leaves_or_goes_silent_ends_the_wait(make, clock, end):
    s = make(lease=True, timeout=0.5)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    event(s, b, "compute_request", seq=7)
    if end == "close":
        s.close(a, "test")
    else:
        clock.advance(0.3)
        event(s, b, "heartbeat")
        clock.advance(0.3)
        s.reap()
    msgs = drain_outbox(box_b)
    assert msgs[0] == GrantMsg(7, 0, pytest.approx(0.6 if end == "suspend" else 0.0))
    # alone on the device after the holder left, not while it is only silent (it may come back)
    assert msgs[1:] == ([LeaseMsg(True)] if end == "close" else [])


def test_a_held_back_request_can_be_withdrawn(make):
    s = make(lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    event(s, b, "compute_request", seq=7)
    event(s, b, "compute_done")  # gave up waiting: no error, and no grant later
    event(s, a, "lease_released")
    assert drain_outbox(box_b) == []
    assert [e.name for e in s.events.events() if e.job == "new"][-1] == "cancel"


def test_a_suspended_holder_loses_its_lease_and_may_regain_it_alone(make, clock):
    s = make(lease=True, timeout=0.5)
    a, box = leased(s)
    clock.advance(0.6)
    s.reap()
    assert drain_outbox(box) == [LeaseMsg(False)]
    event(s, a, "lease_released")  # it woke up, read the revocation and answered: nothing to do
    event(s, a, "compute_request", iteration=1, seq=2)
    assert drain_outbox(box) == [GrantMsg(2, 1, 0.0), LeaseMsg(True)]


def test_a_holder_that_never_answers_loses_the_device_after_the_heartbeat_timeout(make, clock):
    s = make(lease=True, timeout=0.5)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    event(s, b, "compute_request", seq=7)
    for _ in range(4):  # the holder keeps heartbeating but never sends LEASE_RELEASED
        clock.advance(0.15)
        event(s, a, "heartbeat")
        event(s, b, "heartbeat")
        s.reap()
    assert drain_outbox(box_b) == [GrantMsg(7, 0, pytest.approx(0.6))]
    assert "lease_expired" in [e.name for e in s.events.events()]


def test_a_switch_to_a_blocking_policy_waits_for_the_ranks_that_computed_without_grants(make):
    """Under passthrough a rank reports its compute phase only when it ends, so at a switch to
    exclusive the device may look idle while that rank computes: requests are held back until
    every rank on the device has said what it is doing."""
    s = make("passthrough", lease=True)
    a, box_a = join(s, job="a", world=1, rank=0, device=0)
    b, box_b = join(s, job="b", world=1, rank=0, device=0)
    old, box_old = join(s, leases=False, job="old", world=1, rank=0, device=1)
    s.steering.set_policy("exclusive")
    for box in (box_a, box_b, box_old):
        assert drain_outbox(box) == [PolicyMsg("exclusive", True)]
    event(s, b, "lease_released")  # b was idle
    event(s, b, "compute_request", seq=1)
    assert drain_outbox(box_b) == []  # a has not answered: it may be computing
    event(s, a, "compute_request", seq=9, no_wait=True)  # it was: its held request comes first
    event(s, a, "lease_released")
    assert drain_outbox(box_b) == []  # behind a now
    event(s, a, "compute_done")
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    event(s, old, "compute_request", seq=1)  # a client that knows no leases is not waited for
    assert drain_outbox(box_old) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1


@pytest.mark.parametrize("how", ["drain", "policy"])
def test_drain_and_policy_switch_revoke_the_lease(make, how):
    s = make(lease=True)
    _, box = leased(s)
    if how == "drain":
        s.steering.drain(0, True)
        assert drain_outbox(box) == [LeaseMsg(False)]
    else:
        s.steering.set_policy("crossover")
        assert drain_outbox(box) == [LeaseMsg(False), PolicyMsg("crossover", True)]
    assert [LeaseRevoke.of(e).reason for e in s.events.events() if e.name is LeaseRevoke.name][0]
