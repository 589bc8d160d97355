"""The scheduler core: silent, dead and departed ranks (suspension, eviction, shutdown)."""
from __future__ import annotations

import pytest

from crossover.daemon.api import FailedPrecondition, InvalidRequest, NotFound, Phase
from crossover.daemon.messages import CloseMsg, GrantMsg
from tests.unit.daemon.scheduler._world import _PID, _events_of, _phase, drain_outbox, event, ident, join

# ---- liveness ----------------------------------------------------------


def test_a_silent_rank_is_suspended_at_the_timeout_and_evicted_much_later(make, clock):
    s = make(timeout=0.5, evict_after=3.0)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    clock.advance(0.3)
    event(s, b, "heartbeat")
    assert s.reap() == []
    clock.advance(0.3)  # a silent for 0.6 s, b for 0.3 s: a is suspended, its grant goes to b
    assert s.reap() == []
    assert [type(m) for m in drain_outbox(box_b)] == [GrantMsg]
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0)]  # its own old grant; its stream stays open
    assert _phase(s, a) is Phase.SUSPENDED
    assert _events_of(s, 0)[-2:] == ["suspend", "release"]
    for _ in range(4):  # b keeps talking, a stays silent (2.6 s)
        clock.advance(0.5)
        event(s, b, "heartbeat")
        assert s.reap() == []
    clock.advance(0.5)  # a silent for 3.1 s > evict_after
    event(s, b, "heartbeat")
    assert s.reap() == [a]
    assert isinstance(drain_outbox(box_a)[-1], CloseMsg)
    with pytest.raises(NotFound):
        event(s, a, "heartbeat")


def test_a_suspended_waiter_resumes_with_its_request_still_queued(make, clock):
    s = make(timeout=0.5)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=7)  # b waits behind a ...
    clock.advance(0.6)
    event(s, a, "heartbeat")
    assert s.reap() == []  # ... and goes silent: suspended
    assert _phase(s, b) is Phase.SUSPENDED
    event(s, a, "compute_done")  # the device is free, but b is not in the rotation
    assert drain_outbox(box_b) == []
    event(s, a, "compute_request", seq=2)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)] == [1, 2]
    event(s, b, "heartbeat")  # b speaks again: its request for seq 7 is queued again, behind a's grant
    assert drain_outbox(box_b) == []
    assert _phase(s, b) is Phase.WAITING
    event(s, a, "compute_done")
    assert [m.seq for m in drain_outbox(box_b)] == [7]
    assert _events_of(s, 1, "job-b")[-4:] == ["suspend", "resume", "request", "grant"]


def test_a_suspended_holder_may_report_its_compute_done_late(make, clock):
    s = make(timeout=0.5)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=4)
    clock.advance(0.6)
    event(s, b, "heartbeat")
    s.reap()  # a, holding, is suspended: b gets the device
    assert [m.seq for m in drain_outbox(box_b)] == [4]
    event(s, a, "compute_done")  # a was only slow: its late release is accepted, not an error
    event(s, a, "compute_request", seq=2)  # and it queues behind b
    assert [m.seq for m in drain_outbox(box_a)] == [1]
    event(s, b, "compute_done")
    assert [m.seq for m in drain_outbox(box_a)] == [2]
    event(s, a, "compute_done")
    with pytest.raises(FailedPrecondition):  # forgiveness is for one late release only
        event(s, a, "compute_done")


def test_evict_after_shorter_than_the_heartbeat_timeout_is_refused(make):
    with pytest.raises(InvalidRequest, match="evict_after_s"):
        make(timeout=1.0, evict_after=0.5)


def test_dead_process_is_evicted(make, pids):
    s = make()
    a, box_a = join(s, rank=0, pid=_PID - 1)
    b, box_b = join(s, rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=3)
    pids.dead.add(_PID - 1)
    assert s.reap() == [a]
    msgs = drain_outbox(box_a)
    assert isinstance(msgs[-1], CloseMsg) and "gone" in msgs[-1].reason
    assert [m.seq for m in drain_outbox(box_b)] == [3]


def test_registered_but_never_attached_is_evicted(make, clock):
    s = make(timeout=0.5)
    reg = s.register(ident())
    clock.advance(4.0)
    assert s.reap() == []
    clock.advance(1.5)  # past max(5 s, 4 x timeout)
    assert s.reap() == [reg.session_id]


def test_close_is_idempotent_and_frees_the_grant(make):
    s = make()
    a, _ = join(s, rank=0)
    b, box_b = join(s, rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=9)
    assert s.close(a, "stream ended") is True
    assert s.close(a, "stream ended") is False
    assert [m.seq for m in drain_outbox(box_b)] == [9]
    # the rank may register again after it left
    s.register(ident(rank=0))


def test_shutdown_grants_every_waiter_and_closes_streams(make):
    s = make()
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    c, box_c = join(s, job="job-c", rank=0)
    d, box_d = join(s, job="job-d", rank=0)
    event(s, a, "compute_request", iteration=3, seq=1)
    event(s, b, "compute_request", iteration=3, seq=2)
    event(s, c, "compute_request", iteration=8, seq=4)
    drain_outbox(box_a)
    s.shutdown()
    assert [type(m) for m in drain_outbox(box_a)] == [CloseMsg]
    b_msgs, c_msgs = drain_outbox(box_b), drain_outbox(box_c)
    assert [type(m) for m in b_msgs] == [GrantMsg, CloseMsg] and b_msgs[0].seq == 2
    assert [type(m) for m in c_msgs] == [GrantMsg, CloseMsg] and (c_msgs[0].seq, c_msgs[0].iteration) == (4, 8)
    assert [type(m) for m in drain_outbox(box_d)] == [CloseMsg]
    with pytest.raises(FailedPrecondition, match="shutting down"):
        s.register(ident(job="late"))
    assert s.steering.snapshot()[1] == []
    # A rank's event already on the wire is ignored: its stream must end with the grant, not an error.
    event(s, b, "heartbeat")
    event(s, c, "compute_done", iteration=8)
    assert drain_outbox(box_b) == [] and drain_outbox(box_c) == []
