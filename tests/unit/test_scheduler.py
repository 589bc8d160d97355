"""The scheduler core without gRPC: a fake clock, a fake `pid_alive`, CPU devices.

Grants are read from each session's outbox, exactly what the gRPC stream drains.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.daemon.api import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound, Phase
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.scheduler import AliveMsg, CloseMsg, GrantMsg, Identity, LeaseMsg, PolicyMsg, Scheduler, ShareMsg
from tools.harness.oracles import compute_intervals, grants_out_of_turn, overlaps

# pids above Linux's largest pid_max (2**22): psutil never finds such a process.
_PID = 10_000_000
_pids = itertools.count(_PID)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakePids:
    """`pid_alive` that says yes unless a pid was marked dead."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    def __call__(self, pid: int) -> bool:
        return pid not in self.dead


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pids() -> FakePids:
    return FakePids()


@pytest.fixture
def make(clock, pids):
    """Build a scheduler on N CPU devices with the fakes injected."""
    made: list[Scheduler] = []

    def build(policy: str = "exclusive", n_devices: int = 2, timeout: float = 0.5,
              evict_after: float = 5.0, lease: bool = False) -> Scheduler:
        inv = Inventory([Device(i, "cpu", f"cpu{i}", (i,)) for i in range(n_devices)])
        s = Scheduler(inv, policy, node="node-t", event_log=EventLog(clock=clock), heartbeat_interval_s=0.1,
                      heartbeat_timeout_s=timeout, clock=clock, pid_alive=pids, evict_after_s=evict_after,
                      lease=lease)
        made.append(s)
        return s

    yield build
    for s in made:
        s.shutdown()


def ident(job: str = "job-a", rank: int = 0, world: int = 2, device: int = 0, local_rank: int | None = None,
          local_size: int | None = None, pid: int | None = None, name: str | None = None) -> Identity:
    return Identity(job_id=job, job_name=name or f"name-{job}", rank=rank,
                    local_rank=rank if local_rank is None else local_rank, world_size=world,
                    local_size=world if local_size is None else local_size, node="ignored", device=device,
                    pid=next(_pids) if pid is None else pid)


def drain_outbox(box: queue.SimpleQueue, shares: bool = False) -> list:
    """The messages queued for a session; `ShareMsg`s only when asked for, heartbeat answers
    (`AliveMsg`) never (most tests are about the rest)."""
    out = []
    while True:
        try:
            msg = box.get_nowait()
        except queue.Empty:
            return out
        if isinstance(msg, AliveMsg) or (isinstance(msg, ShareMsg) and not shares):
            continue
        out.append(msg)


def join(s: Scheduler, leases: bool = True, **kw) -> tuple[str, queue.SimpleQueue]:
    reg = s.register(ident(**kw), accepts_leases=leases)
    return reg.session_id, s.attach(reg.session_id)


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
    assert s.snapshot()[1] == []  # nothing half-registered


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
        s.event("nope", "heartbeat")
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
    s.event(sid, "compute_request", iteration=4, seq=17)
    (msg,) = drain_outbox(box)
    assert msg == GrantMsg(seq=17, iteration=4, waited_s=0.0)


def test_waiter_is_granted_on_release_with_waited_time(make, clock):
    s = make()
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", iteration=0, seq=1)
    s.event(b, "compute_request", iteration=0, seq=5)
    assert drain_outbox(box_b) == []
    clock.advance(0.25)
    s.event(a, "compute_done", iteration=0, duration_s=0.2)
    (msg,) = drain_outbox(box_b)
    assert msg.seq == 5 and msg.waited_s == pytest.approx(0.25)
    assert [m.seq for m in drain_outbox(box_a)] == [1]


def test_a_rank_never_hears_of_a_grant_or_lease_before_the_event_log_shows_it(make):
    s = make(lease=True)
    seen: list[tuple[str, int]] = []  # (message, grant or lease entries logged when it was delivered)

    def deliver(msg) -> None:
        if isinstance(msg, (GrantMsg, LeaseMsg)):
            kind = "grant" if isinstance(msg, GrantMsg) else "lease" if msg.held else "lease_revoke"
            seen.append((kind, sum(e["event"] == kind for e in s.events.snapshot())))

    a = s.register(ident(rank=0), accepts_leases=True).session_id
    s.attach(a, deliver)
    s.event(a, "compute_request", iteration=0, seq=1)  # a lone rank: granted and leased
    b = s.register(ident(rank=1), accepts_leases=True).session_id
    s.attach(b, deliver)
    s.event(a, "compute_done", iteration=0, comm_begins=True)
    s.event(a, "lease_released")
    s.event(b, "compute_request", iteration=0, seq=1)
    assert seen == [("grant", 1), ("lease", 1), ("lease_revoke", 1), ("grant", 2)]


def test_compute_done_without_grant_is_refused(make):
    s = make()
    sid, _ = join(s)
    with pytest.raises(FailedPrecondition, match="holds no grant"):
        s.event(sid, "compute_done", iteration=0)


def test_second_request_while_waiting_is_refused(make):
    s = make()
    a, _ = join(s, rank=0)
    b, _ = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=1)
    for sid in (a, b):
        with pytest.raises(FailedPrecondition, match="requested the device"):
            s.event(sid, "compute_request", seq=2)


@pytest.mark.parametrize("duration", [-0.1, float("nan"), 1e9])
def test_implausible_duration_is_refused(make, duration):
    s = make()
    sid, _ = join(s)
    with pytest.raises(InvalidRequest, match="duration_s"):
        s.event(sid, "comm_end", duration_s=duration)


def test_negative_iteration_and_unknown_kind_are_refused(make):
    s = make()
    sid, _ = join(s)
    with pytest.raises(InvalidRequest, match="iteration"):
        s.event(sid, "compute_request", iteration=-7)
    with pytest.raises(InvalidRequest, match="unknown event kind"):
        s.event(sid, "dance")


def test_comm_begin_while_holding_releases_the_grant(make):
    s = make()
    a, _ = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=2)
    s.event(a, "comm_begin", iteration=0)
    assert [m.seq for m in drain_outbox(box_b)] == [2]
    s.event(a, "comm_end", iteration=0, duration_s=0.05)


def test_compute_done_while_waiting_withdraws_the_request(make):
    s = make()
    a, _ = join(s, rank=0)
    b, box_b = join(s, rank=1)
    c, box_c = join(s, job="job-c", rank=0)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=1)
    s.event(c, "compute_request", seq=1)
    s.event(b, "compute_done")  # b gave up waiting (grant timeout) and computed unscheduled
    s.event(a, "compute_done")
    assert drain_outbox(box_b) == []
    assert [m.seq for m in drain_outbox(box_c)] == [1]


# ---- liveness ----------------------------------------------------------


def _phase(s: Scheduler, sid: str) -> Phase:
    return s._sessions[sid].phase  # noqa: SLF001 (test introspection)


def _events_of(s: Scheduler, rank: int) -> list[str]:
    return [e["event"] for e in s.events.snapshot() if e.get("job") == "job-a" and e.get("rank") == rank]


def test_a_silent_rank_is_suspended_at_the_timeout_and_evicted_much_later(make, clock):
    s = make(timeout=0.5, evict_after=3.0)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=1)
    clock.advance(0.3)
    s.event(b, "heartbeat")
    assert s.reap() == []
    clock.advance(0.3)  # a silent for 0.6 s, b for 0.3 s: a is suspended, its grant goes to b
    assert s.reap() == []
    assert [type(m) for m in drain_outbox(box_b)] == [GrantMsg]
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0)]  # its own old grant; its stream stays open
    assert _phase(s, a) is Phase.SUSPENDED
    assert _events_of(s, 0)[-2:] == ["suspend", "release"]
    for _ in range(4):  # b keeps talking, a stays silent (2.6 s)
        clock.advance(0.5)
        s.event(b, "heartbeat")
        assert s.reap() == []
    clock.advance(0.5)  # a silent for 3.1 s > evict_after
    s.event(b, "heartbeat")
    assert s.reap() == [a]
    assert isinstance(drain_outbox(box_a)[-1], CloseMsg)
    with pytest.raises(NotFound):
        s.event(a, "heartbeat")


def test_a_suspended_waiter_resumes_with_its_request_still_queued(make, clock):
    s = make(timeout=0.5)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=7)  # b waits behind a ...
    clock.advance(0.6)
    s.event(a, "heartbeat")
    assert s.reap() == []  # ... and goes silent: suspended
    assert _phase(s, b) is Phase.SUSPENDED
    s.event(a, "compute_done")  # the device is free, but b is not in the rotation
    assert drain_outbox(box_b) == []
    s.event(a, "compute_request", seq=2)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)] == [1, 2]
    s.event(b, "heartbeat")  # b speaks again: its request for seq 7 is queued again, behind a's grant
    assert drain_outbox(box_b) == []
    assert _phase(s, b) is Phase.WAITING
    s.event(a, "compute_done")
    assert [m.seq for m in drain_outbox(box_b)] == [7]
    assert _events_of(s, 1)[-4:] == ["suspend", "resume", "request", "grant"]


def test_a_suspended_holder_may_report_its_compute_done_late(make, clock):
    s = make(timeout=0.5)
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=4)
    clock.advance(0.6)
    s.event(b, "heartbeat")
    s.reap()  # a, holding, is suspended: b gets the device
    assert [m.seq for m in drain_outbox(box_b)] == [4]
    s.event(a, "compute_done")  # a was only slow: its late release is accepted, not an error
    s.event(a, "compute_request", seq=2)  # and it queues behind b
    assert [m.seq for m in drain_outbox(box_a)] == [1]
    s.event(b, "compute_done")
    assert [m.seq for m in drain_outbox(box_a)] == [2]
    s.event(a, "compute_done")
    with pytest.raises(FailedPrecondition):  # forgiveness is for one late release only
        s.event(a, "compute_done")


def test_evict_after_shorter_than_the_heartbeat_timeout_is_refused(make):
    with pytest.raises(InvalidRequest, match="evict_after_s"):
        make(timeout=1.0, evict_after=0.5)


def test_dead_process_is_evicted(make, pids):
    s = make()
    a, box_a = join(s, rank=0, pid=_PID - 1)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=3)
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
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=9)
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
    s.event(a, "compute_request", iteration=3, seq=1)
    s.event(b, "compute_request", iteration=3, seq=2)
    s.event(c, "compute_request", iteration=8, seq=4)
    drain_outbox(box_a)
    s.shutdown()
    assert [type(m) for m in drain_outbox(box_a)] == [CloseMsg]
    b_msgs, c_msgs = drain_outbox(box_b), drain_outbox(box_c)
    assert [type(m) for m in b_msgs] == [GrantMsg, CloseMsg] and b_msgs[0].seq == 2
    assert [type(m) for m in c_msgs] == [GrantMsg, CloseMsg] and (c_msgs[0].seq, c_msgs[0].iteration) == (4, 8)
    assert [type(m) for m in drain_outbox(box_d)] == [CloseMsg]
    with pytest.raises(FailedPrecondition, match="shutting down"):
        s.register(ident(job="late"))
    assert s.snapshot()[1] == []
    # A rank's event already on the wire is ignored: its stream must end with the grant, not an error.
    s.event(b, "heartbeat")
    s.event(c, "compute_done", iteration=8)
    assert drain_outbox(box_b) == [] and drain_outbox(box_c) == []


# ---- leases --------------------------------------------------------------


def holders_over_time(s: Scheduler, device: int = 0) -> int:
    """The most ranks the event log ever shows holding ``device`` at once."""
    held: set = set()
    most = 0
    for e in s.events.snapshot():
        if e.get("device") != device:
            continue
        if e["event"] == "grant":
            held.add((e["job"], e["rank"]))
        elif e["event"] in ("release", "leave"):
            held.discard((e["job"], e["rank"]))
        most = max(most, len(held))
    return most


def test_a_lone_rank_is_leased_and_then_not_sent_grants(make):
    s = make(lease=True)
    a, box = join(s, rank=0)
    s.event(a, "compute_request", iteration=0, seq=1)
    assert drain_outbox(box) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    s.event(a, "compute_done", iteration=0, comm_begins=True)
    for i in (1, 2):
        s.event(a, "compute_request", iteration=i, seq=i + 1, no_wait=True)
        s.event(a, "compute_done", iteration=i, comm_begins=True)
    assert drain_outbox(box) == []  # the rank did not wait, so nothing is sent
    # a request made before the rank read its lease is still answered: it is waiting for that grant
    s.event(a, "compute_request", iteration=3, seq=4)
    assert drain_outbox(box) == [GrantMsg(4, 3, 0.0)]
    log = [e["event"] for e in s.events.snapshot()]
    assert log.count("grant") == 4 and log.count("release") == 3 and log.count("lease") == 1


def test_no_lease_when_the_device_is_shared_or_leases_are_off(make):
    s = make(lease=True)
    a, box_a = join(s, rank=0, device=0)
    join(s, rank=1, device=0)
    s.event(a, "compute_request", seq=1)
    assert drain_outbox(box_a) == [GrantMsg(1, 0, 0.0)]
    off = make(lease=False)
    b, box_b = join(off, job="solo", world=1, rank=0)
    off.event(b, "compute_request", seq=1)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    old_client = make(lease=True)
    c, box_c = join(old_client, leases=False, job="solo", world=1, rank=0)
    old_client.event(c, "compute_request", seq=1)
    assert drain_outbox(box_c) == [GrantMsg(1, 0, 0.0)]


def test_passthrough_leases_nothing(make):
    s = make("passthrough", lease=True)
    a, box = join(s, rank=0)
    s.event(a, "compute_request", seq=1)
    assert drain_outbox(box) == []


def leased(s: Scheduler) -> tuple[str, queue.SimpleQueue]:
    a, box = join(s, job="old", world=1, rank=0, device=0)
    s.event(a, "compute_request", iteration=0, seq=1)
    s.event(a, "compute_done", iteration=0, comm_begins=True)
    assert drain_outbox(box) == [GrantMsg(1, 0, 0.0), LeaseMsg(True)]
    return a, box


def test_a_newcomer_waits_for_the_holders_requests_in_flight(make):
    """The hazard: the holder computes under its lease while its request is still on the wire.

    The newcomer's request must not reach the policy before the holder's
    LEASE_RELEASED, which follows that request on the holder's stream.
    """
    s = make(lease=True)
    a, box_a = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    assert drain_outbox(box_a) == [LeaseMsg(False)]
    s.event(b, "compute_request", iteration=0, seq=1)
    assert drain_outbox(box_b) == []  # held back although the daemon has not seen the holder compute
    assert [r.ident.job_id for r in s.snapshot()[0][0].waiting] == ["new"]
    s.event(a, "compute_request", iteration=1, seq=2, no_wait=True)  # before the holder saw the revoke
    s.event(a, "lease_released")
    assert drain_outbox(box_b) == []  # queued behind the holder now
    s.event(a, "compute_done", iteration=1, comm_begins=True)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1
    # from now on the holder waits like everyone else
    s.event(a, "compute_request", iteration=2, seq=3)
    assert drain_outbox(box_a) == []
    s.event(b, "compute_done", iteration=0)
    assert drain_outbox(box_a) == [GrantMsg(3, 2, 0.0)]
    events = [e["event"] for e in s.events.snapshot()]
    assert events.count("lease_revoke") == 1 and events.count("lease_released") == 1


def test_a_holder_computing_at_the_hand_over_keeps_the_device_under_crossover(make):
    """The holder's request in flight says it computes already: it holds the device at once.

    Under `crossover` the newcomer is first in turn order, so a plain request from the
    holder would be queued behind it, and the newcomer granted at LEASE_RELEASED while
    the holder still computes.
    """
    s = make(policy="crossover", lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    s.event(b, "compute_request", iteration=0, seq=1)
    s.event(a, "compute_request", iteration=1, seq=2, no_wait=True)
    s.event(a, "lease_released")
    assert drain_outbox(box_b) == []
    assert [r.ident.job_id for r in s.snapshot()[0][0].holders] == ["old"]
    s.event(a, "compute_done", iteration=1, comm_begins=True)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1


def test_the_order_check_allows_a_lease_hand_over_and_catches_a_grant_out_of_turn(make):
    """The co-located jobs test judges every grant by the daemon's log (`grants_out_of_turn`).

    At a lease hand-over the log shows the newcomer's request first, then the holder's,
    granted at once: the holder was already computing, and the newcomer's request was
    held back. That is the daemon's contract, not a grant out of turn. A grant that skips
    a smaller waiting key is still caught.
    """
    s = make(policy="crossover", lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)  # "new" < "old": first on equal turns
    s.event(b, "compute_request", iteration=0, seq=1)
    s.event(a, "compute_request", iteration=1, seq=2, no_wait=True)
    s.event(a, "lease_released")
    s.event(a, "compute_done", iteration=1, comm_begins=True)
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    events = s.events.snapshot()
    assert grants_out_of_turn(events) == []

    unleased = [e for e in events if not e["event"].startswith("lease")]
    assert grants_out_of_turn(unleased) == [
        "grant to (0, 'old', 0) at (1, 'old') while [(0, 'new')] waited"]


def test_the_newcomer_is_granted_at_the_release_when_the_holder_was_idle(make):
    s = make(lease=True)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    s.event(b, "compute_request", seq=7)
    s.event(a, "lease_released")
    assert drain_outbox(box_b) == [GrantMsg(7, 0, 0.0)]


@pytest.mark.parametrize("end", ["close", "suspend"])
def test_a_holder_that_leaves_or_goes_silent_ends_the_wait(make, clock, end):
    s = make(lease=True, timeout=0.5)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    s.event(b, "compute_request", seq=7)
    if end == "close":
        s.close(a, "test")
    else:
        clock.advance(0.3)
        s.event(b, "heartbeat")
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
    s.event(b, "compute_request", seq=7)
    s.event(b, "compute_done")  # gave up waiting: no error, and no grant later
    s.event(a, "lease_released")
    assert drain_outbox(box_b) == []
    assert [e["event"] for e in s.events.snapshot() if e.get("job") == "new"][-1] == "cancel"


def test_a_suspended_holder_loses_its_lease_and_may_regain_it_alone(make, clock):
    s = make(lease=True, timeout=0.5)
    a, box = leased(s)
    clock.advance(0.6)
    s.reap()
    assert drain_outbox(box) == [LeaseMsg(False)]
    s.event(a, "lease_released")  # it woke up, read the revocation and answered: nothing to do
    s.event(a, "compute_request", iteration=1, seq=2)
    assert drain_outbox(box) == [GrantMsg(2, 1, 0.0), LeaseMsg(True)]


def test_a_holder_that_never_answers_loses_the_device_after_the_heartbeat_timeout(make, clock):
    s = make(lease=True, timeout=0.5)
    a, _ = leased(s)
    b, box_b = join(s, job="new", world=1, rank=0, device=0)
    s.event(b, "compute_request", seq=7)
    for _ in range(4):  # the holder keeps heartbeating but never sends LEASE_RELEASED
        clock.advance(0.15)
        s.event(a, "heartbeat")
        s.event(b, "heartbeat")
        s.reap()
    assert drain_outbox(box_b) == [GrantMsg(7, 0, pytest.approx(0.6))]
    assert "lease_expired" in [e["event"] for e in s.events.snapshot()]


def test_a_switch_to_a_blocking_policy_waits_for_the_ranks_that_computed_without_grants(make):
    """Under passthrough a rank reports its compute phase only when it ends, so at a switch to
    exclusive the device may look idle while that rank computes: requests are held back until
    every rank on the device has said what it is doing."""
    s = make("passthrough", lease=True)
    a, box_a = join(s, job="a", world=1, rank=0, device=0)
    b, box_b = join(s, job="b", world=1, rank=0, device=0)
    old, box_old = join(s, leases=False, job="old", world=1, rank=0, device=1)
    s.set_policy("exclusive")
    for box in (box_a, box_b, box_old):
        assert drain_outbox(box) == [PolicyMsg("exclusive", True)]
    s.event(b, "lease_released")  # b was idle
    s.event(b, "compute_request", seq=1)
    assert drain_outbox(box_b) == []  # a has not answered: it may be computing
    s.event(a, "compute_request", seq=9, no_wait=True)  # it was: its held request comes first
    s.event(a, "lease_released")
    assert drain_outbox(box_b) == []  # behind a now
    s.event(a, "compute_done")
    assert drain_outbox(box_b) == [GrantMsg(1, 0, 0.0)]
    s.event(old, "compute_request", seq=1)  # a client that knows no leases is not waited for
    assert drain_outbox(box_old) == [GrantMsg(1, 0, 0.0)]
    assert holders_over_time(s) == 1


@pytest.mark.parametrize("how", ["drain", "policy"])
def test_drain_and_policy_switch_revoke_the_lease(make, how):
    s = make(lease=True)
    _, box = leased(s)
    if how == "drain":
        s.drain(0, True)
        assert drain_outbox(box) == [LeaseMsg(False)]
    else:
        s.set_policy("crossover")
        assert drain_outbox(box) == [LeaseMsg(False), PolicyMsg("crossover", True)]
    assert [e["reason"] for e in s.events.snapshot() if e["event"] == "lease_revoke"][0]


# ---- operator side -----------------------------------------------------


def test_set_policy_requeues_and_announces(make):
    s = make("exclusive")
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    idle, box_idle = join(s, job="job-c", rank=0)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=2)
    drain_outbox(box_a)
    assert s.set_policy("passthrough") == "passthrough"
    assert s.policy_name == "passthrough"
    assert drain_outbox(box_a) == [PolicyMsg("passthrough", False)]  # no second grant for the holder
    # b was waiting: the policy update alone frees it (passthrough sends no grants; nobody waits for them)
    assert drain_outbox(box_b) == [PolicyMsg("passthrough", False)]
    assert drain_outbox(box_idle) == [PolicyMsg("passthrough", False)]
    per_dev, _ = s.snapshot()
    assert {r.ident.rank for r in per_dev[0][0]} == {0, 1}
    # both finish normally under the new policy
    s.event(a, "compute_done")
    s.event(b, "compute_done")
    assert [e["new"] for e in s.events.snapshot() if e["event"] == "policy"] == ["passthrough"]


def test_passthrough_records_grants_but_sends_none(make):
    s = make("passthrough")
    a, box_a = join(s, rank=0)
    for i in range(3):
        s.event(a, "compute_request", iteration=i, seq=i + 1)
        s.event(a, "compute_done", iteration=i, comm_begins=True)
    assert drain_outbox(box_a) == []
    assert [e["event"] for e in s.events.snapshot() if e.get("rank") == 0].count("grant") == 3


def test_a_compute_done_can_stand_for_its_request_too_and_is_dated_back(make, clock):
    """A rank that does not wait sends one message per iteration: the request rides on the release."""
    s = make("passthrough")
    a, box = join(s, rank=0)
    s.event(a, "compute_request", iteration=0, seq=1)
    clock.advance(0.03)
    s.event(a, "compute_done", iteration=0, comm_begins=True)
    t0 = clock.t
    clock.advance(0.5)
    s.event(a, "compute_done", iteration=1, seq=2, duration_s=0.1, requested=True, comm_s=0.4, comm_begins=True)
    log = [e for e in s.events.snapshot() if e.get("job") == "job-a"][-5:]
    assert [e["event"] for e in log] == ["comm_end", "request", "grant", "release", "comm_begin"]
    assert [e["t"] - t0 for e in log] == pytest.approx([0.4, 0.4, 0.4, 0.5, 0.5])
    assert log[0]["duration_s"] == 0.4 and log[3]["held_s"] == pytest.approx(0.1)
    rank = s.snapshot()[1][0]
    assert (rank.iteration, rank.phase, rank.mean_comm_s) == (1, Phase.COMM, pytest.approx(0.4))
    assert rank.mean_compute_s == pytest.approx((0.03 + 0.1) / 2)
    assert drain_outbox(box) == []
    with pytest.raises(InvalidRequest, match="comm_s"):
        s.event(a, "compute_done", requested=True, comm_s=-1.0)


def test_a_rank_s_dated_events_never_fall_before_its_previous_one(make, clock):
    # Two batches, the first slow on the wire (0.8 ms) and the next fast (0.1 ms): dated by
    # arrival less age, iteration 1's start (0.4 ms after iteration 0 ended) would land before
    # that end, and the rank's own compute phases would overlap in the log.
    s = make("passthrough")
    a, _ = join(s, rank=0)
    s.event(a, "compute_done", iteration=0, seq=1, duration_s=0.004, requested=True, comm_begins=True)
    end0 = clock.t
    clock.advance(0.0044 - 0.0008 + 0.0001)  # iteration 1 ran 0.4 ms after it for 4 ms, then a faster batch
    s.event(a, "compute_done", iteration=1, seq=2, duration_s=0.004, requested=True, comm_s=0.0003,
            comm_begins=True, ago_s=0.0001)
    log = [e for e in s.events.snapshot() if e.get("job") == "job-a"]
    grants = [e["t"] for e in log if e["event"] == "grant"]
    releases = [e["t"] for e in log if e["event"] == "release"]
    assert releases[0] == pytest.approx(end0)
    assert grants[1] >= releases[0]  # without the clamp: 0.3 ms before it
    assert all(b["t"] >= a_["t"] for a_, b in zip(log, log[1:]))


def test_one_decision_is_logged_at_one_instant_so_a_rank_s_phases_never_overlap(clock, pids):
    # The log's own clock reads a little later than the decision it records (it runs after the
    # scheduler's work). A phase logged that late could end after its rank's next phase began,
    # when that next phase is dated back from its report (here the log reads 17 us late).
    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    s = Scheduler(inv, "passthrough", node="node-t", event_log=EventLog(clock=lambda: clock.t + 17e-6),
                  clock=clock, pid_alive=pids)
    try:
        a, _ = join(s, rank=0)
        s.event(a, "compute_done", iteration=0, seq=1, duration_s=0.004, requested=True, comm_begins=True)
        clock.advance(0.0044)  # the next phase began 5 us after that one ended
        s.event(a, "compute_done", iteration=1, seq=2, duration_s=0.0044 - 5e-6, requested=True,
                comm_s=0.0003, comm_begins=True)
        log = [e for e in s.events.snapshot() if e.get("job") == "job-a"]
        assert overlaps([iv for ivs in compute_intervals(log).values() for iv in ivs]) == []
        assert all(b["t"] >= a_["t"] for a_, b in zip(log, log[1:]))
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
    s = Scheduler(inv, "exclusive", node="node-t", event_log=EventLog(clock=clock), clock=clock, pid_alive=pids)
    try:
        a, _ = join(s, job="job-a", rank=0, leases=False)
        b, _ = join(s, job="job-b", rank=0, leases=False)
        s.event(a, "compute_request", iteration=0, seq=1)

        def x() -> None:
            s.event(a, "compute_done", iteration=0, comm_begins=True)

        def y() -> None:
            s.event(b, "compute_request", iteration=0, seq=1)
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
        times = [e["t"] for e in s.events.snapshot()]
        assert times == sorted(times)
    finally:
        s.shutdown()


def test_compute_done_can_begin_the_allreduce_in_the_same_message(make, clock):
    s = make("exclusive")
    a, box_a = join(s, rank=0)
    s.event(a, "compute_request", iteration=0, seq=1)
    clock.advance(0.1)
    s.event(a, "compute_done", iteration=0, comm_begins=True)
    assert _phase(s, a) is Phase.COMM
    clock.advance(0.3)
    s.event(a, "compute_request", iteration=1, seq=2)  # ends the comm the done began
    rank = s.snapshot()[1][0]
    assert rank.mean_compute_s == pytest.approx(0.1) and rank.mean_comm_s == pytest.approx(0.3)
    assert [e["event"] for e in s.events.snapshot() if e.get("rank") == 0][-5:] == [
        "release", "comm_begin", "comm_end", "request", "grant"]


def test_set_policy_requeues_waiting_ranks_at_their_turn_not_their_iteration(make):
    s = make("exclusive")
    c, box_c = join(s, job="job-c", rank=0, world=1)
    a, box_a = join(s, job="job-a", rank=0, world=1)
    b, box_b = join(s, job="job-b", rank=0, world=1)
    s.event(c, "compute_request", iteration=0, seq=1)  # c holds; a and b wait
    s.event(a, "compute_request", iteration=5, seq=1, turn_base=0)  # turn 5
    s.event(b, "compute_request", iteration=1, seq=1, turn_base=10)  # turn 11, though its iteration is smaller
    s.set_policy("crossover")
    s.close(c, "stream ended")  # c leaves (were it to stay, crossover would keep its turn-0 place for it)
    assert [type(m) for m in drain_outbox(box_a)] == [PolicyMsg, GrantMsg]  # the smaller turn goes first
    assert [type(m) for m in drain_outbox(box_b)] == [PolicyMsg]


def test_set_policy_keeps_a_computing_rank_on_its_device_whatever_its_turn(make):
    s = make("exclusive")
    z, box_z = join(s, job="job-z", rank=0, world=1)
    a, box_a = join(s, job="job-a", rank=0, world=1)
    s.event(z, "compute_request", iteration=3, seq=1)  # z computes at turn 3
    s.event(a, "compute_request", iteration=0, seq=1)  # a waits at turn 0: first in crossover's order
    s.set_policy("crossover")
    assert drain_outbox(box_a) == [PolicyMsg("crossover", True)]  # not granted beside z
    s.event(z, "compute_done", iteration=3, comm_begins=True)
    assert [type(m) for m in drain_outbox(box_a)] == [GrantMsg]
    assert holders_over_time(s) == 1


def test_set_policy_back_to_exclusive_leaves_no_ghost_request(make):
    """Two ranks computing under passthrough; after a switch to exclusive the second is
    queued behind the first. When it reports compute_done it must leave that queue, or a
    stale grant would later mark it as computing and refuse its next request."""
    s = make("passthrough")
    a, box_a = join(s, rank=0)
    b, box_b = join(s, rank=1)
    s.event(a, "compute_request", seq=1)
    s.event(b, "compute_request", seq=1)
    s.set_policy("exclusive")
    s.event(b, "compute_done")
    s.event(a, "compute_done")
    drain_outbox(box_a), drain_outbox(box_b)
    per_dev, _ = s.snapshot()
    assert per_dev[0][0] == [] and per_dev[0][1] == []
    s.event(b, "comm_begin")
    s.event(b, "comm_end", duration_s=0.01)
    s.event(b, "compute_request", seq=2)  # must not raise
    assert [m.seq for m in drain_outbox(box_b)] == [2]
    s.event(a, "compute_request", seq=2)
    assert drain_outbox(box_a) == []  # exclusive again: a waits for b
    s.event(b, "compute_done")
    assert [m.seq for m in drain_outbox(box_a)] == [2]


def test_set_policy_unknown_keeps_the_old_one(make):
    s = make("exclusive")
    with pytest.raises(NotFound, match="choose one of"):
        s.set_policy("bogus")
    assert s.policy_name == "exclusive"


def test_drain_refuses_new_ranks_and_resume_accepts_them(make):
    s = make(n_devices=2)
    s.register(ident(job="before", device=0))
    assert s.drain(0, True) is True
    assert s.is_draining(0) and not s.is_draining(1)
    with pytest.raises(FailedPrecondition, match="draining"):
        s.register(ident(job="during", device=0))
    s.register(ident(job="other-device", device=1))
    assert s.drain(0, False) is False
    assert not s.is_draining(0)
    s.register(ident(job="during", device=0))
    with pytest.raises(InvalidRequest, match="does not exist"):
        s.drain(5, True)
    assert [e["event"] for e in s.events.snapshot() if e["event"] in ("drain", "resume")] == ["drain", "resume"]


def test_snapshot_shows_holder_waiting_order_and_stats(make, clock):
    s = make()
    a, _ = join(s, rank=0)
    b, _ = join(s, rank=1)
    c, _ = join(s, job="job-c", rank=0)
    idle, _ = join(s, job="job-d", rank=0)
    other_dev, _ = join(s, job="job-e", rank=0, device=1)
    s.event(a, "compute_request", iteration=0, seq=1)
    clock.advance(0.1)
    s.event(a, "compute_done", iteration=0)
    s.event(a, "comm_begin", iteration=0)
    clock.advance(0.3)
    s.event(a, "comm_end", iteration=0)
    s.event(a, "compute_request", iteration=1, seq=2)
    s.event(c, "compute_request", iteration=5, seq=1)
    s.event(b, "compute_request", iteration=1, seq=1)
    clock.advance(0.2)
    per_dev, ranks = s.snapshot()
    holders, waiting, others, order = per_dev[0]
    assert [(r.ident.job_id, r.ident.rank) for r in holders] == [("job-a", 0)]
    assert [(r.ident.job_id, r.ident.rank) for r in waiting] == [("job-c", 0), ("job-a", 1)]
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
    s.event(a, "compute_request", iteration=2, seq=1)
    clock.advance(0.05)
    s.event(a, "compute_done", iteration=2)
    log = [e for e in s.events.snapshot() if e.get("job") == "job-a"]
    assert [e["event"] for e in log] == ["register", "request", "grant", "release"]
    grant, release = log[2], log[3]
    assert grant["device"] == 1 and release["device"] == 1
    assert grant["node"] == "node-t" and grant["rank"] == 0 and grant["job_name"] == "name-job-a"
    assert grant["iteration"] == 2
    assert release["t"] - grant["t"] == pytest.approx(0.05)
    assert release["held_s"] == pytest.approx(0.05)


def test_uptime_follows_the_clock(make, clock):
    s = make()
    clock.advance(12.5)
    assert s.uptime() == pytest.approx(12.5)


# ---- yields and overdue holders ----------------------------------------


def test_a_yield_frees_the_device_and_the_pieces_count_as_one_compute_phase(make, clock):
    s = make("exclusive")
    a, box_a = join(s, job="job-a", device=0)
    b, box_b = join(s, job="job-b", device=0)
    s.event(a, "compute_request", iteration=3, seq=1)
    clock.advance(0.010)
    s.event(a, "compute_done", iteration=3, duration_s=0.010, yields=True)  # a metric allreduce begins
    s.event(b, "compute_request", iteration=0, seq=1)
    assert [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "the yielded device went to nobody"
    s.event(a, "compute_request", iteration=3, seq=2)  # back from the collective: same iteration
    s.event(b, "compute_done", iteration=0, duration_s=0.002, comm_begins=True)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)] == [1, 2]
    clock.advance(0.030)
    s.event(a, "compute_done", iteration=3, duration_s=0.030, comm_begins=True)
    rank = next(r for r in s.snapshot()[1] if r.ident.job_id == "job-a")
    assert rank.iteration == 3
    assert rank.mean_compute_s == pytest.approx(0.040)  # both pieces, one phase
    assert s._sessions[a].stats.compute_n == 1 and s._sessions[a].stats.compute_ema == pytest.approx(0.040)
    yields = [e for e in s.events.snapshot() if e["event"] == "release" and e.get("yields")]
    assert len(yields) == 1


def test_a_holder_far_past_its_compute_time_is_overdue_and_the_next_rank_is_served(make, clock):
    s = make("exclusive", evict_after=100.0, timeout=100.0)
    s.overdue_factor, s.overdue_after_s = 10.0, 1.0
    a, box_a = join(s, job="job-a", device=0)
    b, box_b = join(s, job="job-b", device=0)
    for it in range(3):  # a measured compute time of 50 ms
        s.event(a, "compute_request", iteration=it, seq=it + 1)
        clock.advance(0.05)
        s.event(a, "compute_done", iteration=it, duration_s=0.05, comm_begins=True)
    s.event(a, "compute_request", iteration=3, seq=4)  # then it blocks somewhere while holding
    s.event(b, "compute_request", iteration=0, seq=1)
    clock.advance(0.9)
    s.reap()
    assert not [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "served before the floor"
    clock.advance(0.2)
    s.reap()
    assert [m for m in drain_outbox(box_b) if isinstance(m, GrantMsg)], "the overdue holder kept the device"
    assert s.overdue_total == 1
    per_dev, _ = s.snapshot()
    assert [r.phase for r in per_dev[0].others] == [Phase.OVERDUE]
    assert [e["event"] for e in s.events.snapshot()].count("overdue") == 1
    s.event(a, "compute_done", iteration=3, duration_s=1.2, comm_begins=True)  # its late end is no error
    s.event(b, "compute_done", iteration=0, duration_s=0.01, comm_begins=True)
    s.event(a, "compute_request", iteration=4, seq=5)
    assert [m.seq for m in drain_outbox(box_a) if isinstance(m, GrantMsg)][-1] == 5
    assert overlaps(compute_intervals(s.events.snapshot())[0]) == []


def test_a_long_holder_nobody_waits_for_is_left_alone(make, clock):
    s = make("exclusive", evict_after=100.0, timeout=100.0)
    s.overdue_after_s = 1.0
    a, _ = join(s, job="job-a", device=0)
    s.event(a, "compute_request", iteration=0, seq=1)
    clock.advance(30.0)
    s.reap()
    assert s.overdue_total == 0


_KINDS = ("compute_request", "compute_request_no_wait", "compute_done", "compute_done_requested", "comm_begin",
          "comm_end", "lease_released", "heartbeat")


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["exclusive", "crossover"]), lease=st.booleans(),
       ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(_KINDS), st.integers(0, 3), st.booleans()),
                    max_size=60))
def test_whatever_ranks_send_a_blocking_policy_never_has_two_holders(policy, lease, ops):
    """The daemon enforces its own invariant: a rank that claims to compute without a grant
    (`no_wait`) and holds no lease is queued like any other request, never made a second holder."""
    clock = FakeClock()
    inv = Inventory([Device(0, "cpu", "cpu0", (0,))])
    s = Scheduler(inv, policy, node="n", event_log=EventLog(clock=clock), heartbeat_interval_s=0.1,
                  heartbeat_timeout_s=5.0, clock=clock, pid_alive=lambda pid: True, evict_after_s=10.0, lease=lease)
    try:
        sids = [s.register(ident(job=f"j{i}", rank=0, world=1, device=0), accepts_leases=True).session_id
                for i in range(3)]
        for sid in sids:
            s.attach(sid)
        for who, kind, iteration, yields in ops:
            clock.advance(0.01)
            try:
                if kind == "compute_request_no_wait":
                    s.event(sids[who], "compute_request", iteration=iteration, seq=iteration + 1, no_wait=True)
                elif kind == "compute_done_requested":
                    s.event(sids[who], "compute_done", iteration=iteration, seq=iteration + 1, requested=True,
                            duration_s=0.005, yields=yields)
                elif kind == "compute_done":
                    s.event(sids[who], "compute_done", iteration=iteration, yields=yields)
                else:
                    s.event(sids[who], kind, iteration=iteration, seq=iteration + 1)
            except (FailedPrecondition, InvalidRequest):
                pass
            holders = s.snapshot()[0][0].holders
            assert len(holders) <= 1, f"two holders after {kind} from session {who}: {holders}"
    finally:
        s.shutdown()


def test_every_heartbeat_is_answered_so_a_rank_can_tell_a_frozen_daemon(make):
    s = make()
    a, box = join(s)
    drain_outbox(box)
    s.event(a, "heartbeat")
    s.event(a, "heartbeat")
    answers = []
    while not box.empty():
        answers.append(box.get_nowait())
    assert [type(m) for m in answers] == [AliveMsg, AliveMsg]
