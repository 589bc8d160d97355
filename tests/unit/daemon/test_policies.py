"""The pure grant policies, driven directly with explicit `now` values.

Row by row for `passthrough` and `exclusive`, then property tests that run
`exclusive` against a tiny reference model (one FIFO queue per device) over
random sequences of join/request/release/leave/cancel.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.daemon import policies
from crossover.daemon.api import CrossoverError, FailedPrecondition, NotFound, RankKey, RankRef
from crossover.daemon.policies import ExclusivePolicy, PassthroughPolicy


def ref(job: str, rank: int, device: int = 0, world: int = 4, joined: float = 0.0) -> RankRef:
    return RankRef(RankKey(job, rank), job_name=f"name-{job}", device=device, world_size=world, joined_at=joined)


A0, A1, B0, B1, C0 = ref("a", 0), ref("a", 1), ref("b", 0), ref("b", 1), ref("c", 0)


def joined(policy, *ranks: RankRef):
    for i, r in enumerate(ranks):
        assert policy.join(r, now=float(i)) == []
    return policy


# ---- registry ----------------------------------------------------------


def test_available_lists_the_builtin_policies():
    names = policies.available()
    assert {"passthrough", "exclusive"} <= set(names)
    assert names == sorted(names)
    for name in names:
        p = policies.create(name)
        assert p.name == name


def test_create_unknown_policy_names_the_choices():
    with pytest.raises(NotFound) as err:
        policies.create("nope")
    msg = str(err.value)
    assert "'nope'" in msg
    for name in policies.available():
        assert name in msg


def test_create_returns_fresh_instances():
    assert policies.create("exclusive") is not policies.create("exclusive")


# ---- passthrough -------------------------------------------------------


def test_passthrough_never_blocks_and_grants_at_once():
    p = joined(PassthroughPolicy(), A0, B0, C0)
    assert p.blocks is False
    assert p.request(A0.key, iteration=0, now=10.0) == [A0.key]
    assert p.request(B0.key, iteration=0, now=10.1) == [B0.key]
    assert p.request(C0.key, iteration=3, now=10.2) == [C0.key]
    view = p.view(0)
    assert set(view.holders) == {A0.key, B0.key, C0.key}
    assert view.waiting == ()
    assert all(p.holds(r.key) for r in (A0, B0, C0))


def test_passthrough_release_and_leave():
    p = joined(PassthroughPolicy(), A0, B0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.0)
    assert p.release(A0.key, now=2.0) == []
    assert not p.holds(A0.key)
    assert p.view(0).holders == (B0.key,)
    with pytest.raises(FailedPrecondition):
        p.release(A0.key, now=2.5)
    assert p.leave(B0.key, now=3.0) == []
    assert p.view(0).holders == ()
    with pytest.raises(NotFound):
        p.request(B0.key, 1, now=4.0)


def test_passthrough_double_request_is_refused():
    p = joined(PassthroughPolicy(), A0)
    p.request(A0.key, 0, now=1.0)
    with pytest.raises(FailedPrecondition):
        p.request(A0.key, 1, now=1.5)


def test_passthrough_cancel_without_pending_request_is_refused():
    p = joined(PassthroughPolicy(), A0)
    with pytest.raises(FailedPrecondition):
        p.cancel(A0.key, now=1.0)


def test_view_of_unused_device_is_empty():
    for p in (PassthroughPolicy(), ExclusivePolicy()):
        view = p.view(7)
        assert (view.device, view.holders, view.waiting) == (7, (), ())


# ---- exclusive: row by row ---------------------------------------------


def test_exclusive_grants_a_free_device_at_once():
    p = joined(ExclusivePolicy(), A0)
    assert p.blocks is True
    assert p.request(A0.key, iteration=0, now=1.0) == [A0.key]
    assert p.holds(A0.key) and not p.is_waiting(A0.key)


def test_exclusive_is_fifo_with_one_holder():
    p = joined(ExclusivePolicy(), A0, B0, C0, A1)
    assert p.request(B0.key, 0, now=1.0) == [B0.key]
    assert p.request(C0.key, 0, now=1.1) == []
    assert p.request(A0.key, 0, now=1.2) == []
    assert p.request(A1.key, 1, now=1.3) == []  # another iteration than A0's: it does not join A0
    view = p.view(0)
    assert view.holders == (B0.key,)
    assert view.waiting == (C0.key, A0.key, A1.key)
    assert p.is_waiting(C0.key) and not p.holds(C0.key)

    granted_order = [B0.key]
    holder = B0.key
    for t in (2.0, 3.0, 4.0):
        nxt = p.release(holder, now=t)
        assert len(nxt) == 1
        holder = nxt[0]
        granted_order.append(holder)
        assert p.view(0).holders == (holder,)
    assert granted_order == [B0.key, C0.key, A0.key, A1.key]
    assert p.release(holder, now=5.0) == []
    assert p.view(0).holders == () and p.view(0).waiting == ()


def test_exclusive_devices_are_independent():
    x0, x1 = ref("x", 0, device=0), ref("x", 1, device=1)
    y0, y1 = ref("y", 0, device=0), ref("y", 1, device=1)
    p = joined(ExclusivePolicy(), x0, x1, y0, y1)
    assert p.request(x0.key, 0, now=1.0) == [x0.key]
    assert p.request(x1.key, 0, now=1.0) == [x1.key]  # device 1 is free although device 0 is held
    assert p.request(y1.key, 0, now=1.1) == []
    assert p.request(y0.key, 0, now=1.2) == []
    assert p.release(x1.key, now=2.0) == [y1.key]  # releasing device 1 never grants device 0
    assert p.view(0).holders == (x0.key,) and p.view(0).waiting == (y0.key,)
    assert p.view(1).holders == (y1.key,) and p.view(1).waiting == ()


def test_exclusive_leave_of_holder_grants_next():
    p = joined(ExclusivePolicy(), A0, B0, C0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    p.request(C0.key, 0, now=1.2)
    assert p.leave(A0.key, now=2.0) == [B0.key]
    assert p.view(0).holders == (B0.key,) and p.view(0).waiting == (C0.key,)
    with pytest.raises(NotFound):
        p.holds(A0.key)


def test_exclusive_leave_of_waiter_keeps_holder_and_order():
    p = joined(ExclusivePolicy(), A0, B0, C0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    p.request(C0.key, 0, now=1.2)
    assert p.leave(B0.key, now=2.0) == []
    assert p.view(0).holders == (A0.key,) and p.view(0).waiting == (C0.key,)
    assert p.release(A0.key, now=3.0) == [C0.key]


def test_exclusive_leave_of_idle_rank_grants_nothing():
    p = joined(ExclusivePolicy(), A0, B0)
    p.request(A0.key, 0, now=1.0)
    assert p.leave(B0.key, now=2.0) == []
    assert p.view(0).holders == (A0.key,)


def test_exclusive_release_of_a_grant_not_held_is_refused():
    p = joined(ExclusivePolicy(), A0, B0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    with pytest.raises(FailedPrecondition, match="does not hold"):
        p.release(B0.key, now=2.0)  # waiting, not holding
    p.release(A0.key, now=2.0)
    with pytest.raises(FailedPrecondition):
        p.release(A0.key, now=2.1)  # released twice
    assert p.view(0).holders == (B0.key,)


def test_exclusive_request_while_holding_or_waiting_is_refused():
    p = joined(ExclusivePolicy(), A0, B0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    for key in (A0.key, B0.key):
        with pytest.raises(FailedPrecondition):
            p.request(key, 1, now=1.5)
    assert p.view(0).holders == (A0.key,) and p.view(0).waiting == (B0.key,)


def test_exclusive_cancel_of_pending_request():
    p = joined(ExclusivePolicy(), A0, B0, C0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    p.request(C0.key, 0, now=1.2)
    assert p.cancel(B0.key, now=2.0) == []
    assert not p.is_waiting(B0.key) and not p.holds(B0.key)
    assert p.view(0).waiting == (C0.key,)
    with pytest.raises(FailedPrecondition, match="no pending request"):
        p.cancel(B0.key, now=2.1)
    with pytest.raises(FailedPrecondition):
        p.cancel(A0.key, now=2.2)  # a holder has nothing pending
    # a cancelled rank may ask again and goes to the back of the queue
    assert p.request(B0.key, 1, now=3.0) == []
    assert p.view(0).waiting == (C0.key, B0.key)


def test_exclusive_release_after_last_waiter_cancelled_leaves_device_idle():
    p = joined(ExclusivePolicy(), A0, B0)
    p.request(A0.key, 0, now=1.0)
    p.request(B0.key, 0, now=1.1)
    p.cancel(B0.key, now=1.5)
    assert p.release(A0.key, now=2.0) == []
    assert p.view(0).holders == () and p.view(0).waiting == ()


@pytest.mark.parametrize("call", [
    lambda p, k: p.request(k, 0, now=1.0),
    lambda p, k: p.release(k, now=1.0),
    lambda p, k: p.cancel(k, now=1.0),
    lambda p, k: p.leave(k, now=1.0),
    lambda p, k: p.holds(k),
    lambda p, k: p.is_waiting(k),
], ids=["request", "release", "cancel", "leave", "holds", "is_waiting"])
@pytest.mark.parametrize("cls", [ExclusivePolicy, PassthroughPolicy])
def test_unknown_rank_is_not_found(cls, call):
    p = joined(cls(), A0)
    with pytest.raises(NotFound, match="not known"):
        call(p, RankKey("ghost", 0))


def test_tick_and_observe_are_inert():
    p = joined(ExclusivePolicy(), A0)
    p.observe(A0.key, "compute", 0.5, now=1.0)
    assert p.tick(now=100.0) == []


# ---- exclusive: properties against a reference model --------------------

_RANKS = [ref(job, r, device=r % 2) for job in ("a", "b", "c") for r in range(2)]  # 3 per device
_KINDS = ("join", "request", "release", "leave", "cancel")


@dataclass
class _Model:
    """What `exclusive` must do: one FIFO per device, the head granted when the device is free."""

    joined: set = field(default_factory=set)
    holder: dict = field(default_factory=dict)  # device -> key
    queue: dict = field(default_factory=lambda: {0: deque(), 1: deque()})
    device: dict = field(default_factory=lambda: {r.key: r.device for r in _RANKS})

    def dispatch(self, dev: int) -> list[RankKey]:
        if self.holder.get(dev) is None and self.queue[dev]:
            self.holder[dev] = self.queue[dev].popleft()
            return [self.holder[dev]]
        return []

    def valid(self, kind: str, key: RankKey) -> bool:
        dev = self.device[key]
        if kind == "join":
            return key not in self.joined
        if key not in self.joined:
            return False
        if kind == "request":
            return self.holder.get(dev) != key and key not in self.queue[dev]
        if kind == "release":
            return self.holder.get(dev) == key
        if kind == "cancel":
            return key in self.queue[dev]
        return True  # leave

    def apply(self, kind: str, key: RankKey) -> list[RankKey]:
        dev = self.device[key]
        if kind == "join":
            self.joined.add(key)
            return []
        if kind == "request":
            self.queue[dev].append(key)
        elif kind == "release":
            self.holder[dev] = None
        elif kind == "cancel":
            self.queue[dev].remove(key)
        elif kind == "leave":
            self.joined.discard(key)
            if self.holder.get(dev) == key:
                self.holder[dev] = None
            if key in self.queue[dev]:
                self.queue[dev].remove(key)
        return self.dispatch(dev)


def _call(p: ExclusivePolicy, kind: str, r: RankRef, now: float) -> list[RankKey]:
    if kind == "join":
        return p.join(r, now)
    if kind == "request":
        return p.request(r.key, 0, now)
    return getattr(p, kind)(r.key, now)


def _check_views(p: ExclusivePolicy, m: _Model) -> None:
    for dev in (0, 1):
        view = p.view(dev)
        assert len(view.holders) <= 1, f"two holders on device {dev}: {view.holders}"
        expected = m.holder.get(dev)
        assert view.holders == ((expected,) if expected is not None else ())
        assert list(view.waiting) == list(m.queue[dev]), "waiting order differs from request order"
        if not view.holders:
            assert not view.waiting, f"device {dev} is free but ranks wait: {view.waiting}"


_ops = st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, len(_RANKS) - 1)), max_size=60)


def _replay_valid(p: ExclusivePolicy, m: _Model, ops: list) -> float:
    """Drive the policy and the model through the valid calls of `ops` (the rest are skipped), one every
    10 ms from 0; returns the time reached."""
    now = 0.0
    for kind, i in ops:
        r = _RANKS[i]
        now += 0.01
        if m.valid(kind, r.key):
            m.apply(kind, r.key)
            _call(p, kind, r, now)
    return now


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_exclusive_matches_fifo_model(ops):
    """Every call returns exactly the model's grants; invalid calls raise and change nothing."""
    p, m = ExclusivePolicy(), _Model()
    now = 0.0
    for kind, i in ops:
        r = _RANKS[i]
        now += 0.01
        if m.valid(kind, r.key):
            assert _call(p, kind, r, now) == m.apply(kind, r.key)
        elif kind != "join":  # re-joining is the scheduler's job to prevent; the policy does not check
            before = (p.view(0), p.view(1))
            with pytest.raises(CrossoverError):
                _call(p, kind, r, now)
            assert (p.view(0), p.view(1)) == before
        _check_views(p, m)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_exclusive_every_waiter_is_eventually_granted(ops):
    """After any history, releasing holders one by one grants every waiting rank once, in FIFO order."""
    p, m = ExclusivePolicy(), _Model()
    now = _replay_valid(p, m, ops)
    for dev in (0, 1):
        expected = list(p.view(dev).waiting)
        granted: list[RankKey] = []
        steps = 0
        while p.view(dev).holders:
            steps += 1
            assert steps <= len(_RANKS) + 1, "drain does not terminate"
            (holder,) = p.view(dev).holders
            now += 0.01
            nxt = p.release(holder, now)
            assert len(nxt) <= 1
            granted += nxt
            for g in nxt:
                assert p.holds(g)
        assert granted == expected
        assert p.view(dev).waiting == ()


# ---- a job's ranks on one device compute together ------------------------


@pytest.mark.parametrize("make", [ExclusivePolicy, policies.CrossoverPolicy])
def test_a_jobs_ranks_on_one_device_are_granted_together(make):
    """Two ranks of one job that share a device: serialising them only adds a hand-over (the job's
    allreduce waits for the last of them anyway), so the second joins the first's grant."""
    p = joined(make(), A0, A1, B0)
    assert p.request(A0.key, 3, now=1.0) == [A0.key]
    assert p.request(B0.key, 0, now=1.1) == []
    assert p.request(A1.key, 3, now=1.2) == [A1.key]  # passes B0: it is part of A's phase, not a new one
    assert p.view(0).holders == (A0.key, A1.key)
    assert p.release(A0.key, now=2.0) == []  # B0 waits for the whole job
    assert p.release(A1.key, now=2.1) == [B0.key]


@pytest.mark.parametrize("make", [ExclusivePolicy, policies.CrossoverPolicy])
def test_a_rank_that_yielded_rejoins_its_job_but_not_another_iteration(make):
    p = joined(make(), A0, A1, B0)
    assert p.request(A0.key, 3, now=1.0) == [A0.key]
    assert p.request(A1.key, 3, now=1.0) == [A1.key]
    assert p.release(A0.key, now=1.1) == []  # A0 yields around a metric's allreduce
    assert p.request(B0.key, 0, now=1.2) == []
    assert p.request(A0.key, 3, now=1.3) == [A0.key]  # and comes back while A1 still holds
    assert p.release(A0.key, now=1.4) == []
    assert p.request(A0.key, 4, now=1.5) == []  # its next iteration is a new phase: B0 goes first
    assert p.release(A1.key, now=1.6) == [B0.key]
    assert p.release(B0.key, now=1.7) == [A0.key]


@pytest.mark.parametrize("make", [ExclusivePolicy, policies.CrossoverPolicy])
def test_ranks_of_two_jobs_never_hold_a_device_together(make):
    p = joined(make(), A0, A1, B0, B1)
    for i, key in enumerate((B0.key, A0.key, A1.key, B1.key)):
        p.request(key, 0, now=1.0 + i / 10)
    assert p.view(0).holders == (B0.key, B1.key)
    assert p.release(B0.key, now=2.0) == [] and p.release(B1.key, now=2.1) == [A0.key, A1.key]
