"""The scheduler core without gRPC: registration and rank events.

A fake clock, a fake `pid_alive`, CPU devices (this folder's `conftest.py`). Grants are read
from each session's outbox, exactly what the gRPC stream drains.
"""
from __future__ import annotations

import pytest

from crossover.daemon.api import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound, PermissionDenied
from crossover.daemon.messages import GrantMsg, LeaseMsg, ShareMsg
from crossover.daemon.policies.classes import Priority
from tests.unit.daemon.scheduler._world import _PID, drain_outbox, event, ident, join

# ---- registration ------------------------------------------------------


def test_each_rank_hears_how_many_others_share_its_device(make, pids):
    s = make("passthrough")
    a, box_a = join(s, job="job-a", rank=0, device=0)
    assert drain_outbox(box_a, shares=True) == [ShareMsg(0)]
    b, box_b = join(s, job="job-b", rank=0, device=0)
    c, box_c = join(s, job="job-c", rank=0, device=1)  # another device: nothing changes on device 0
    assert drain_outbox(box_a, shares=True) == [ShareMsg(1)]
    assert drain_outbox(box_b, shares=True) == [ShareMsg(1)]
    assert drain_outbox(box_c, shares=True) == [ShareMsg(0)]
    s.close(b, "stream ended")
    assert drain_outbox(box_a, shares=True) == [ShareMsg(0)]
    assert drain_outbox(box_c, shares=True) == []


def test_a_job_on_a_node_is_its_first_named_users_and_no_other_user_joins_it(make):
    s = make("crossover")
    a, _ = join(s, job="job-a", rank=0, device=0)
    s.bind_peer(a, 0, 1000)
    b = s.register(ident(job="job-a", rank=1, device=0), asked=Priority.LOW).session_id
    assert s.ownership.class_and_setter("job-a")[0].priority is Priority.NORMAL  # its ask waits: no user named yet
    with pytest.raises(PermissionDenied, match="run by uid 1000; a rank of uid 1001 cannot join it"):
        s.bind_peer(b, 0, 1001)
    s.close(b, "refused")
    assert s.ownership.class_and_setter("job-a")[0].priority is Priority.NORMAL
    c, _ = join(s, job="job-a", rank=1, device=0)
    s.bind_peer(c, 0, 1000)  # the job's own user
    d, _ = join(s, job="job-b", rank=0, device=0)
    s.bind_peer(d, 0, 1001)  # another user's own job
    s.close(a, "done")
    s.close(c, "done")
    e, _ = join(s, job="job-a", rank=0, device=0)
    s.bind_peer(e, 0, 1001)  # once the job has left the node, its id is free again


def test_register_returns_placement_and_policy(make):
    s = make()
    reg = s.register(ident(rank=1, device=1))
    assert reg.node == "node-t"
    assert reg.device == 1
    assert reg.cpu_affinity == (1,)
    assert reg.heartbeat_interval_s == 0.1
    assert (reg.policy, reg.policy_blocks) == ("exclusive", True)
    assert reg.session_id


def test_device_minus_one_is_chosen_from_local_rank(make):
    s = make(n_devices=2)
    assert s.register(ident(rank=0, device=-1, local_rank=0)).device == 0
    assert s.register(ident(rank=1, device=-1, local_rank=1)).device == 1
    assert s.register(ident(job="j3", rank=2, world=4, device=-1, local_rank=2, local_size=4)).device == 0


@pytest.mark.parametrize("bad, words", [
    (dict(rank=2, world=2), "rank=2"),
    (dict(rank=-1), "rank=-1"),
    (dict(world=0, local_size=0, rank=0), "world_size=0"),
    (dict(world=1 << 30, local_size=1), "world_size="),
    (dict(pid=-5), "pid=-5"),
    (dict(pid=0), "pid=0"),
    (dict(device=2), "device=2"),
    (dict(device=-2), "device=-2"),
    (dict(job=""), "job_id"),
    (dict(job="x" * 129), "job_id"),
    (dict(name="n" * 257), "job_name"),
    (dict(local_rank=3, local_size=2), "local_rank=3"),
    (dict(local_size=5, world=2), "local_size=5"),
])
def test_register_rejects_invalid_identity(make, bad, words):
    s = make(n_devices=2)
    with pytest.raises(InvalidRequest) as err:
        s.register(ident(**bad))
    assert words in str(err.value)
    assert s.steering.snapshot()[1] == []  # nothing half-registered


def test_double_registration_is_refused(make):
    s = make()
    s.register(ident(rank=0))
    with pytest.raises(AlreadyExists, match="already registered"):
        s.register(ident(rank=0, pid=_PID - 2))
    # the same rank number of another job is a different rank
    s.register(ident(job="job-b", rank=0))


def test_unknown_session_is_not_found(make):
    s = make()
    with pytest.raises(NotFound, match="unknown session"):
        s.attach("nope")
    with pytest.raises(NotFound):
        event(s, "nope", "heartbeat")
    assert s.close("nope", "test") is False


def test_attach_twice_is_refused(make):
    s = make()
    sid, _ = join(s)
    with pytest.raises(AlreadyExists, match="open stream"):
        s.attach(sid)


# ---- events ------------------------------------------------------------


def test_grant_goes_to_the_outbox_with_the_request_seq(make, clock):
    s = make()
    sid, box = join(s)
    event(s, sid, "compute_request", iteration=4, seq=17)
    (msg,) = drain_outbox(box)
    assert msg == GrantMsg(seq=17, iteration=4, waited_s=0.0)


def test_waiter_is_granted_on_release_with_waited_time(make, clock):
    s = make()
    a, box_a = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    event(s, a, "compute_request", iteration=0, seq=1)
    event(s, b, "compute_request", iteration=0, seq=5)
    assert drain_outbox(box_b) == []
    clock.advance(0.25)
    event(s, a, "compute_done", iteration=0, duration_s=0.2)
    (msg,) = drain_outbox(box_b)
    assert msg.seq == 5 and msg.waited_s == pytest.approx(0.25)
    assert [m.seq for m in drain_outbox(box_a)] == [1]


def test_a_rank_never_hears_of_a_grant_or_lease_before_the_event_log_shows_it(make):
    s = make(lease=True)
    seen: list[tuple[str, int]] = []  # (message, grant or lease entries logged when it was delivered)

    def deliver(msg) -> None:
        if isinstance(msg, (GrantMsg, LeaseMsg)):
            kind = "grant" if isinstance(msg, GrantMsg) else "lease" if msg.held else "lease_revoke"
            seen.append((kind, sum(e.name == kind for e in s.events.events())))

    a = s.register(ident(rank=0), accepts_leases=True).session_id
    s.attach(a, deliver)
    event(s, a, "compute_request", iteration=0, seq=1)  # a lone rank: granted and leased
    b = s.register(ident(job="job-b", rank=1), accepts_leases=True).session_id
    s.attach(b, deliver)
    event(s, a, "compute_done", iteration=0, comm_begins=True)
    event(s, a, "lease_released")
    event(s, b, "compute_request", iteration=0, seq=1)
    assert seen == [("grant", 1), ("lease", 1), ("lease_revoke", 1), ("grant", 2)]


def test_compute_done_without_grant_is_refused(make):
    s = make()
    sid, _ = join(s)
    with pytest.raises(FailedPrecondition, match="holds no grant"):
        event(s, sid, "compute_done", iteration=0)


def test_second_request_while_waiting_is_refused(make):
    s = make()
    a, _ = join(s, rank=0)
    b, _ = join(s, rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    for sid in (a, b):
        with pytest.raises(FailedPrecondition, match="requested the device"):
            event(s, sid, "compute_request", seq=2)


@pytest.mark.parametrize("duration", [-0.1, float("nan"), 1e9])
def test_implausible_duration_is_refused(make, duration):
    s = make()
    sid, _ = join(s)
    with pytest.raises(InvalidRequest, match="duration_s"):
        event(s, sid, "comm_end", duration_s=duration)


def test_a_negative_iteration_is_refused(make):
    s = make()
    sid, _ = join(s)
    with pytest.raises(InvalidRequest, match="iteration"):
        event(s, sid, "compute_request", iteration=-7)


def test_comm_begin_while_holding_releases_the_grant(make):
    s = make()
    a, _ = join(s, rank=0)
    b, box_b = join(s, rank=1)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=2)
    event(s, a, "comm_begin", iteration=0)
    assert [m.seq for m in drain_outbox(box_b)] == [2]
    event(s, a, "comm_end", iteration=0, duration_s=0.05)


def test_compute_done_while_waiting_withdraws_the_request(make):
    s = make()
    a, _ = join(s, rank=0)
    b, box_b = join(s, job="job-b", rank=1)
    c, box_c = join(s, job="job-c", rank=0)
    event(s, a, "compute_request", seq=1)
    event(s, b, "compute_request", seq=1)
    event(s, c, "compute_request", seq=1)
    event(s, b, "compute_done")  # b gave up waiting (grant timeout) and computed unscheduled
    event(s, a, "compute_done")
    assert drain_outbox(box_b) == []
    assert [m.seq for m in drain_outbox(box_c)] == [1]


def test_registrations_past_the_cap_are_refused(make):
    from crossover.daemon.api import ResourceExhausted

    s = make("exclusive", max_sessions=3)
    for i in range(3):
        join(s, job=f"j{i}", device=0)
    with pytest.raises(ResourceExhausted, match="3 registered ranks"):
        join(s, job="j3", device=0)


def test_cpu_percent_is_measured_on_the_first_read(make):
    """psutil measures CPU between two reads: the daemon reads once at registration, so the first
    `crossover queue` shows the rank's use since then (not 0, as a first psutil read would)."""
    import os
    import time

    s = make()
    sid, _ = join(s, pid=os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:  # the "rank" (this process) computes
        pass
    _, ranks = s.steering.snapshot()
    me = next(r for r in ranks if r.ident.pid == os.getpid())
    assert me.cpu_percent > 10, me.cpu_percent


def test_a_rank_the_kernel_does_not_name_cannot_join_a_job_it_named(make):
    s = make("crossover")
    a, _ = join(s, job="job-a", rank=0, device=0)
    b, _ = join(s, job="job-a", rank=1, device=0)
    s.ownership.refuse_unnamed(b)  # nobody named yet: a job whose ranks all came over gRPC
    s.bind_peer(a, 0, 1000)
    with pytest.raises(PermissionDenied, match="run by uid 1000, which the session socket vouches for"):
        s.ownership.refuse_unnamed(join(s, job="job-a", rank=2, world=4, device=0)[0])
    s.ownership.refuse_unnamed(join(s, job="job-b", rank=0, device=0)[0])  # another job: no one's yet
    s.bind_peer(b, 0, 1000)
    s.ownership.refuse_unnamed(b)  # named itself: not its business
