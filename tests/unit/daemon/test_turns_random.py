"""The `turns` policy under random event sequences that follow the scheduler's contract.

Never two holders on a device, and every waiting ready rank is eventually
granted, each once, after any history.
"""
from __future__ import annotations

from typing import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.daemon.api import RankKey, RankRef
from testbed.simulator.turns import TurnsPolicy
from tests.unit.daemon._turns_fixtures import S, ref

# ---- properties: random event sequences ---------------------------------------------------------

_RANKS = [ref(job, r, device=r % 2) for job in ("a", "b", "c") for r in range(4)]  # 2 ranks per job per device
_KINDS = ("join", "request", "release", "leave", "tick", "observe")


class _Shadow:
    """Who may do what next, so the generated calls follow the scheduler's contract."""

    def __init__(self) -> None:
        self.joined: set[RankKey] = set()
        self.waiting: set[RankKey] = set()
        self.holding: set[RankKey] = set()

    def granted(self, keys: list[RankKey]) -> None:
        for k in keys:
            assert k in self.waiting, f"granted {k}, which was not waiting"
            self.waiting.discard(k)
            self.holding.add(k)


def _step(p: TurnsPolicy, sh: _Shadow, kind: str, r: RankRef, now: float, dt: float) -> list[RankKey]:
    k = r.key
    if kind == "join" and k not in sh.joined:
        sh.joined.add(k)
        return p.join(r, now)
    if k not in sh.joined:
        return []
    if kind == "request" and k not in sh.waiting and k not in sh.holding:
        sh.waiting.add(k)
        return p.request(k, 0, now)
    if kind == "release" and k in sh.holding:
        sh.holding.discard(k)
        return p.release(k, now)
    if kind == "leave":
        sh.joined.discard(k)
        sh.waiting.discard(k)
        sh.holding.discard(k)
        return p.leave(k, now)
    if kind == "observe":
        p.observe(k, "comm" if dt < 0.05 else "compute", dt, now)
        return []
    if kind == "tick":
        return p.tick(now)
    return []


def _check(p: TurnsPolicy, sh: _Shadow) -> None:
    for dev in (0, 1):
        view = p.view(dev)
        assert len(view.holders) <= 1, f"two holders on device {dev}: {view.holders}"
        assert set(view.holders) == {k for k in sh.holding if _RANKS_BY_KEY[k].device == dev}
        assert set(view.waiting) == {k for k in sh.waiting if _RANKS_BY_KEY[k].device == dev}
        assert len(view.order) == len({k.job_id for k in sh.joined if _RANKS_BY_KEY[k].device == dev})


_RANKS_BY_KEY = {r.key: r for r in _RANKS}
_ops = st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, len(_RANKS) - 1),
                          st.floats(0.0, 0.2, allow_nan=False)), max_size=80)


def _replay(ops: list, check: Callable[[TurnsPolicy, _Shadow], None] | None = None
            ) -> tuple[TurnsPolicy, _Shadow, float]:
    """A fresh policy driven through `ops`, its grants checked against the shadow's waiters and `check` run
    after every step; returns the policy, the shadow and the time reached."""
    p, sh = TurnsPolicy(), _Shadow()
    now = 0.0
    for kind, i, dt in ops:
        now += dt
        sh.granted(_step(p, sh, kind, _RANKS[i], now, dt))
        if check is not None:
            check(p, sh)
    return p, sh, now


@settings(max_examples=250, deadline=None)
@given(_ops)
def test_never_two_holders_on_a_device(ops):
    _replay(ops, check=_check)


@settings(max_examples=250, deadline=None)
@given(_ops)
def test_every_waiting_ready_rank_is_eventually_granted(ops):
    """After any history: holders finish, time passes and ticks come; every waiter is served, each once."""
    p, sh, now = _replay(ops)
    expected = set(sh.waiting)
    served: list[RankKey] = []
    for _ in range(4 * len(_RANKS)):
        if not sh.waiting and not sh.holding:
            break
        now += 0.01
        for k in sorted(sh.holding):
            sh.holding.discard(k)
            got = p.release(k, now)
            sh.granted(got)
            served += got
        now += S.max_wait_s  # longer than any bounded wait
        got = p.tick(now)
        sh.granted(got)
        served += got
        _check(p, sh)
    assert not sh.waiting, f"still waiting after the drain: {sh.waiting}"
    assert sorted(served) == sorted(expected)
