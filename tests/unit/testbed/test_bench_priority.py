"""bench.priority's arithmetic: what a low job can get at most beside a production job kept whole."""
from __future__ import annotations

import pytest

from bench.priority import best_within, low_ceiling, pinned
from crossover.daemon.policies.isolation import IsolationController, IsolationSettings


def test_a_low_jobs_ceiling_is_the_device_time_the_production_job_leaves_free():
    assert low_ceiling(0.150, 0.300) == pytest.approx(1.0)  # 1:1: half the device is free, a low job needs half
    assert low_ceiling(0.150, 0.300, lows=2) == pytest.approx(0.5)
    assert low_ceiling(0.150, 0.250, interference=0.19) == pytest.approx((0.4 / 0.6) / 1.19)
    assert low_ceiling(0.300, 0.300) == 0.0  # no gaps: only the guard serves a low job
    assert low_ceiling(0.0, 0.300) == 0.0


def test_a_low_job_on_one_node_needs_its_own_time_alone():
    # a one-rank low job has no allreduce: alone it keeps the device busy all the time, so the half of the
    # production job's device time that is free gives it half its speed, not all of it
    assert low_ceiling(0.150, 0.300, low_iter_s=0.150) == pytest.approx(0.5)
    assert low_ceiling(0.150, 0.300, low_iter_s=0.300) == low_ceiling(0.150, 0.300)


def test_the_best_a_budget_gives_within_the_target_is_read_where_the_production_job_crosses_it():
    frontier = [(0.99, 0.1), (0.98, 0.2), (0.96, 0.4), (0.95, 0.5)]
    assert best_within(frontier, 0.97) == pytest.approx(0.3)  # halfway from 0.98 to 0.96
    assert best_within(frontier, 0.95) == pytest.approx(0.5)  # the last budget still keeps it
    assert best_within(frontier, 0.995) is None  # even the least budget costs the production job too much
    assert best_within([(0.99, 0.1), (0.96, 0.3), (0.98, 0.35)], 0.97) == pytest.approx(0.35)  # noise: the most


def test_a_pinned_budget_neither_rises_nor_falls_whatever_the_production_job_keeps():
    def budget_after(settings: IsolationSettings) -> float:
        ctl = IsolationController(settings)
        i, t = 0, 0.0
        while t < 20.0:  # a solo window, then shared ones with the job at half its speed alone
            ctl.step(frozenset({"prod"}), frozenset({"low"}), t)
            ctl.request("prod", i, t)
            i, t = i + 1, t + (0.1 if t < 2.0 else 0.2)
        return ctl.budget

    assert budget_after(IsolationSettings(initial=0.3)) < 0.3  # the controller cuts it
    assert budget_after(pinned(0.3).isolation) == pytest.approx(0.3)


def test_the_frontier_and_the_rules_are_simulator_runs_asked_one_at_a_time(capsys):
    from bench.priority import main

    for argv in (["--bed", "model", "--frontier"], ["--bed", "sim", "--frontier", "--rules"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "run on --bed sim" in err and "ask for one" in err
