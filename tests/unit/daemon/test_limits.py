"""What one client may cost the daemon: the token bucket and the connection count."""
from __future__ import annotations

from crossover.daemon.limits import Connections, EventBudget


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_budget_allows_its_burst_then_its_rate():
    clock = _Clock()
    budget = EventBudget(per_s=100, burst=50, clock=clock)
    assert all(budget.spend(1) for _ in range(50))
    assert not budget.spend(1)
    clock.t += 0.1  # 10 more at 100/s
    assert budget.spend(10)
    assert not budget.spend(1)
    clock.t += 60  # refills to the burst, never past it
    assert budget.spend(50) and not budget.spend(1)


def test_a_batch_larger_than_the_burst_never_passes_and_zero_means_no_limit():
    assert not EventBudget(per_s=100, burst=50, clock=_Clock()).spend(51)
    unlimited = EventBudget(per_s=0, burst=1, clock=_Clock())
    assert all(unlimited.spend(10_000) for _ in range(100))


def test_connections_are_refused_at_the_cap_and_counted_back_down():
    conns = Connections(cap=2)
    assert conns.enter() and conns.enter()
    assert not conns.enter()
    assert conns.count == 2
    conns.leave()
    assert conns.enter() and conns.count == 2
