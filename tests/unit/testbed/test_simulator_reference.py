"""The offline reference: fixed cyclic serve orders, and the exhaustive search over them."""
from __future__ import annotations

import pytest

from crossover.daemon.api import RankKey, RankRef
from testbed.simulator import JobSpec, SimConfig, simulate
from testbed.simulator.reference import FixedOrderPolicy, best_cyclic_orders, run_orders


def _ref(job: str) -> RankRef:
    return RankRef(RankKey(job, 0), job, 0, 1, 0.0)


def test_fixed_order_waits_for_the_job_whose_place_it_is_and_skips_a_job_that_left():
    p = FixedOrderPolicy({(0, 0): ("a", "b", "c")}, node=0)
    for j in "abc":
        p.join(_ref(j), 0.0)
    assert p.request(RankKey("b", 0), 0, 0.0) == []  # a's place: the device waits
    assert p.request(RankKey("a", 0), 0, 0.1) == [RankKey("a", 0)]
    assert p.release(RankKey("a", 0), 0.2) == [RankKey("b", 0)]
    p.request(RankKey("a", 0), 1, 0.25)
    assert p.release(RankKey("b", 0), 0.3) == []  # c's place, c has not asked
    assert p.leave(RankKey("c", 0), 0.4) == [RankKey("a", 0)]  # c left: a is next


def _span(iters: int = 30) -> list[JobSpec]:
    nodes = lambda *ns: tuple((n, 0) for n in ns)  # noqa: E731
    return [JobSpec("A", nodes(0, 1), 0.03, 0.06, iterations=iters), JobSpec("B", nodes(1, 2), 0.06, 0.03,
                                                                           iterations=iters),
            JobSpec("C", nodes(0, 2), 0.045, 0.045, iterations=iters)]


def test_the_search_tries_every_combination_and_its_best_is_at_least_fifo_and_reproducible():
    cfg = SimConfig(seed=0)
    ref = best_cyclic_orders(_span(), n_nodes=3, config=cfg)
    assert ref.searched == 2 ** 3 and ref.deadlocked == 0
    fifo = simulate(_span(), "exclusive", n_nodes=3, config=cfg).throughput_iter_s
    assert ref.throughput_iter_s >= fifo * 0.999
    again = run_orders(_span(), ref.orders, n_nodes=3, config=cfg)
    assert again.throughput_iter_s == pytest.approx(ref.throughput_iter_s)


def test_an_instance_too_large_to_search_is_refused():
    with pytest.raises(ValueError, match="max_combinations"):
        best_cyclic_orders(_span(), n_nodes=3, max_combinations=7)
