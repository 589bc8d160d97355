"""The cluster simulator: its model checked against closed forms, then the policies it drives.

Exact numbers where the model has no randomness (no jitter): one job alone,
processor sharing, link sharing. Then the comparisons the benchmark relies on,
determinism under a seed, jobs arriving, leaving and crashing, ticks, and
`simulate_small` for the comparison with the emulated cluster.
"""
from __future__ import annotations

import pytest

from crossover.daemon import policies
from crossover.daemon.api import RankKey
from crossover.daemon.policies import ExclusivePolicy
from testbed.simulator import (
    POLICIES,
    SMALL_POLICIES,
    JobSpec,
    SimConfig,
    SimulationError,
    alone_iteration_s,
    simulate,
    simulate_small,
)
from testbed.simulator.turns import TurnsPolicy

C = M = 0.05
TWO_NODES = ((0, 0), (1, 0))


def job(name: str, c: float = C, m: float = M, iters: int | None = 60, place=TWO_NODES, **kw) -> JobSpec:
    return JobSpec(name, place, c, m, iterations=iters, **kw)


def no_overlap(spans) -> None:
    by_dev: dict[tuple[int, int], list] = {}
    for s in spans:
        by_dev.setdefault((s.node, s.device), []).append(s)
    for dev, ss in by_dev.items():
        ss.sort(key=lambda s: s.start)
        for a, b in zip(ss, ss[1:]):
            assert b.start >= a.end - 1e-12, f"{dev}: {a} overlaps {b}"


# ---- the model against closed forms ---------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_one_job_alone_runs_at_one_over_c_plus_m(policy):
    res = simulate([job("a", iters=50)], policy, n_nodes=2, config=SimConfig(warmup_iterations=0))
    (j,) = res.jobs
    assert j.iterations == 50 and j.finished
    assert j.iter_per_s == pytest.approx(1 / (C + M), rel=1e-9)
    assert j.slowdown == pytest.approx(1.0)
    assert res.makespan_s == pytest.approx(50 * (C + M))
    assert res.device_busy == pytest.approx(C / (C + M))
    assert res.fairness == pytest.approx(1.0) and res.stalled_jobs == []


def test_heterogeneous_ranks_wait_for_the_slowest():
    spec = JobSpec("a", ((0, 0), (1, 0), (2, 0)), (0.02, 0.05, 0.03), 0.01, iterations=20)
    res = simulate([spec], "exclusive", n_nodes=3)
    assert res.jobs[0].iter_per_s == pytest.approx(1 / (0.05 + 0.01))
    assert alone_iteration_s(spec) == pytest.approx(0.06)
    jittered = JobSpec("b", spec.placement, spec.compute_s, spec.comm_s, iterations=20, jitter=0.2)
    assert alone_iteration_s(jittered) > 0.06  # the max of jittered draws exceeds the max of the means


@pytest.mark.parametrize("shared, period", [(True, 2 * C * 1.1 + 2 * 0.02), (False, 2 * C * 1.1 + 0.02)])
def test_unscheduled_co_location_shares_device_and_link(shared, period):
    """Two jobs computing at once each run at 1/(2*(1+penalty)); their allreduces halve the link if shared."""
    jobs = [job("a", m=0.02), job("b", m=0.02)]
    res = simulate(jobs, "passthrough", n_nodes=2, config=SimConfig(switch_penalty=0.1, shared_links=shared))
    for j in res.jobs:
        assert j.iter_per_s == pytest.approx(1 / period, rel=1e-6)


def test_exclusive_serializes_and_beats_unscheduled_with_a_switch_penalty():
    cfg = SimConfig(switch_penalty=0.2, record_trace=True, seed=3)
    jobs = [job("a", jitter=0.05), job("b", jitter=0.05)]
    ex = simulate(jobs, "exclusive", n_nodes=2, config=cfg)
    pt = simulate(jobs, "passthrough", n_nodes=2, config=cfg)
    no_overlap(ex.trace)
    assert ex.throughput_iter_s >= pt.throughput_iter_s
    assert ex.device_busy > pt.device_busy * 0.9


def test_two_identical_jobs_under_crossover_reach_85_percent_of_the_pipeline_bound():
    jobs = [job("a", iters=150, jitter=0.05), job("b", iters=150, jitter=0.05)]
    res = simulate(jobs, "crossover", n_nodes=2, config=SimConfig(seed=1, record_trace=True))
    bound_per_job = 1 / max(2 * C, 2 * M)
    assert res.bound_iter_s == pytest.approx(2 * bound_per_job)
    for j in res.jobs:
        assert j.iter_per_s >= 0.85 * bound_per_job, j
    assert res.bound_fraction >= 0.85
    assert res.fairness < 1.2
    assert res.idle_waiting < 0.05
    no_overlap(res.trace)


@pytest.mark.parametrize("policy", ["exclusive", "crossover", "turns", "turns-nosync"])
def test_blocking_policies_never_put_two_ranks_on_a_device(policy):
    place = [((0, 0), (1, 1), (2, 0)), ((0, 0), (1, 0), (2, 1)), ((0, 1), (1, 1), (2, 0)), ((0, 1), (1, 0), (2, 1))]
    jobs = [JobSpec(f"j{i}", p, (0.03, 0.04, 0.05), 0.02 + 0.01 * i, iterations=40, jitter=0.2)
            for i, p in enumerate(place)]
    res = simulate(jobs, policy, n_nodes=3, devices_per_node=2,
                   config=SimConfig(record_trace=True, startup_spread_s=0.2, seed=5))
    assert res.completed_iterations == 4 * 40 and res.stalled_jobs == []
    no_overlap(res.trace)


def test_a_policy_granting_two_ranks_is_caught():
    class Greedy(ExclusivePolicy):
        def request(self, key, iteration, now):
            dev = self._q.enqueue(key, now)
            self._q.grant(dev, key)
            return [key]

    with pytest.raises(SimulationError, match="let 2 ranks compute"):
        simulate([job("a"), job("b")], Greedy, n_nodes=2)


def test_a_policy_granting_a_rank_that_does_not_wait_is_caught():
    class Confused(ExclusivePolicy):
        def request(self, key, iteration, now):
            self._q.enqueue(key, now)
            return []  # grants only on ticks ...

        def tick(self, now):
            return [RankKey("ghost", 0)]  # ... and then the wrong rank

    with pytest.raises(SimulationError, match="not a rank waiting"):
        simulate([job("a")], Confused, n_nodes=2, config=SimConfig(tick_s=0.01))


# ---- determinism ------------------------------------------------------------------------------


def _jittery(seed: int, policy: str = "crossover"):
    jobs = [job("a", jitter=0.2), job("b", c=0.03, jitter=0.2), job("c", m=0.08, jitter=0.2, arrival_s=0.5)]
    return simulate(jobs, policy, n_nodes=2, config=SimConfig(seed=seed, startup_spread_s=0.3, record_trace=True))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_same_seed_same_result_event_for_event(policy):
    a, b = _jittery(7, policy), _jittery(7, policy)
    assert a.trace == b.trace
    assert a.to_dict() == b.to_dict()


def test_another_seed_another_result():
    assert _jittery(7).trace != _jittery(8).trace


def test_skewed_nodes_ask_late_each_by_its_own_draw():
    """`skew_s`: each node learns that an allreduce ended up to that much later. A job alone starts each
    iteration's compute on both nodes at once without skew, and up to `skew_s` apart with it."""
    def apart(skew: float) -> list[float]:
        res = simulate([job("a")], "exclusive", n_nodes=2, config=SimConfig(seed=3, skew_s=skew, record_trace=True))
        by: dict[int, list[float]] = {}
        for span in res.trace:
            by.setdefault(span.iteration, []).append(span.start)
        return [max(v) - min(v) for i, v in by.items() if i > 0]
    assert max(apart(0.0)) < 1e-9
    assert 0.001 < max(apart(0.005)) <= 0.005


@pytest.mark.parametrize("policy", ["exclusive", "crossover", "crossover-link"])
def test_with_skewed_nodes_every_job_finishes(policy):
    jobs = [job("a", jitter=0.1), job("b", c=0.03, jitter=0.1), job("c", m=0.08, jitter=0.1)]
    res = simulate(jobs, policy, n_nodes=2, config=SimConfig(seed=3, skew_s=0.005))
    assert all(j.finished and j.iterations == 60 for j in res.jobs)


def test_a_negative_skew_is_refused():
    with pytest.raises(ValueError, match="skew_s"):
        simulate([job("a")], "crossover", n_nodes=2, config=SimConfig(skew_s=-0.001))


# ---- arrivals, departures, crashes ------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_jobs_arrive_leave_and_crash(policy):
    jobs = [
        job("long", iters=80),
        job("late", iters=20, arrival_s=1.0),  # arrives mid-run, leaves after 20 iterations
        job("crash", iters=None, arrival_s=0.5, leave_s=2.5, jitter=0.1),  # killed mid-run
        job("never", iters=10, arrival_s=1.0, leave_s=1.01),  # killed before all its ranks joined
    ]
    res = simulate(jobs, policy, n_nodes=2, config=SimConfig(startup_spread_s=0.05, seed=2, record_trace=True))
    by = {j.name: j for j in res.jobs}
    assert by["long"].finished and by["long"].iterations == 80
    assert by["late"].finished and by["late"].iterations == 20
    assert not by["crash"].finished and by["crash"].left_at == pytest.approx(2.5) and by["crash"].iterations > 0
    assert by["never"].iterations == 0 and by["never"].left_at == pytest.approx(1.01)
    assert res.stalled_jobs == []
    assert all(s.end <= 2.5 + 1e-9 for s in res.trace if s.job == "crash")
    if policy != "passthrough":
        no_overlap(res.trace)
    # Once the others are gone, "long" runs at its alone speed again.
    alone_since = max(j.left_at for j in res.jobs if j.name != "long") + 0.5
    tail = [s for s in res.trace if s.job == "long" and s.start > alone_since and s.node == 0]
    gaps = [b.start - a.start for a, b in zip(tail, tail[1:])]
    assert gaps and max(gaps) == pytest.approx(C + M, rel=1e-6)


def test_horizon_stops_open_ended_jobs():
    with pytest.raises(ValueError, match="horizon"):
        simulate([job("a", iters=None)], "crossover", n_nodes=2)
    res = simulate([job("a", iters=None)], "crossover", n_nodes=2, config=SimConfig(horizon_s=2.0))
    assert res.makespan_s == 2.0 and not res.jobs[0].finished
    assert res.jobs[0].iterations == pytest.approx(2.0 / (C + M), abs=1)


def test_bad_input_is_refused_with_the_value_named():
    with pytest.raises(ValueError, match=r"\(5, 0\)"):
        simulate([JobSpec("a", ((5, 0),), C, M, iterations=1)], "exclusive", n_nodes=2)
    with pytest.raises(ValueError, match="used twice"):
        simulate([job("a"), job("a")], "exclusive", n_nodes=2)
    with pytest.raises(ValueError, match="choose one of"):
        simulate([job("a")], "nope", n_nodes=2)


# ---- ticks ----------------------------------------------------------------------------------------


def _late_owner():
    """b's rank on node 0 waits for its slow rank on node 1, so on node 0 b is often late for its turn."""
    return [job("a", iters=60, place=((0, 0),), m=0.02, jitter=0.1),
            JobSpec("b", TWO_NODES, (0.01, 0.2), 0.02, iterations=20, jitter=0.3)]


def test_turns_deadlines_are_honoured_without_periodic_ticks():
    ticks: list[tuple[float, list]] = []

    class Counting(TurnsPolicy):
        def tick(self, now):
            granted = super().tick(now)
            ticks.append((now, granted))
            return granted

    exact = simulate(_late_owner(), Counting, n_nodes=2, config=SimConfig(seed=4))
    assert exact.stalled_jobs == [] and exact.completed_iterations == 80
    assert 0 < len(ticks) < 100  # at the deadlines, not every 0.5 ms ...
    assert all(granted for _, granted in ticks)  # ... and each one skips a late owner
    ticks.clear()
    reaper = simulate(_late_owner(), Counting, n_nodes=2, config=SimConfig(seed=4, tick_s=0.1))
    assert reaper.completed_iterations == 80
    phases = {round(t % 0.1, 6) for t, _ in ticks}
    assert len(phases) <= 2  # like the daemon's reaper: a fixed cadence per node


def test_policy_with_next_deadline_is_ticked_exactly_then():
    calls: list[float] = []

    class Announcing(TurnsPolicy):
        def tick(self, now):
            calls.append(now)
            return super().tick(now)

    res = simulate([job("a", iters=10), job("b", iters=10, arrival_s=0.3)], Announcing, n_nodes=2)
    assert res.stalled_jobs == [] and res.completed_iterations == 20
    assert len(calls) < 50  # only at deadlines, not every 0.5 ms


def test_policy_without_deadlines_gets_periodic_ticks():
    class Opaque:
        """Wraps TurnsPolicy so the simulator cannot read its deadlines."""

        name, blocks = "opaque", True

        def __init__(self):
            self._p = TurnsPolicy()

        def __getattr__(self, attr):
            return getattr(self._p, attr)

    exact = simulate(_late_owner(), "turns", n_nodes=2)
    opaque = simulate(_late_owner(), Opaque, n_nodes=2)
    assert opaque.completed_iterations == exact.completed_iterations
    assert opaque.jobs[0].iter_per_s == pytest.approx(exact.jobs[0].iter_per_s, rel=0.02)


# ---- the policies by name ----------------------------------------------------------------------------


def test_the_simulator_runs_the_daemons_policies_and_turns_without_synchronization():
    assert set(POLICIES) == {*policies.available(), "turns", "turns-nosync", "crossover-link"}
    nosync = POLICIES["turns-nosync"]()
    assert isinstance(nosync, TurnsPolicy) and nosync.settings.tiebreak == "join_order"
    assert nosync.name == "turns-nosync"
    assert all(POLICIES[name]().name == name for name in policies.available())


# ---- simulate_small ------------------------------------------------------------------------------------


def test_simulate_small_reports_every_policy():
    rows = {p: simulate_small(0.05, 0.05, 2, p, iterations=60) for p in SMALL_POLICIES}
    for p, r in rows.items():
        assert r["policy"] == p and r["throughput_iter_s"] > 0 and 0 < r["bound_fraction"] <= 1.05
    assert rows["alone"]["throughput_iter_s"] == pytest.approx(1 / 0.1, rel=0.05)
    assert rows["sequential"]["throughput_iter_s"] == pytest.approx(rows["alone"]["throughput_iter_s"])
    assert rows["sequential"]["slowdown"] == pytest.approx([2.0, 2.0], rel=0.05)
    assert rows["exclusive"]["throughput_iter_s"] > 1.35 * rows["passthrough"]["throughput_iter_s"]
    with pytest.raises(ValueError, match="choose one of"):
        simulate_small(0.05, 0.05, 2, "nope")


def test_fifo_links_serve_allreduces_in_arrival_order_and_unscheduled_jobs_fall_into_alternation():
    # Fair sharing keeps two unscheduled 1:1 jobs in lockstep (both compute together, then both
    # communicate at half speed): ~half the pipeline bound. Serving the link in arrival order
    # breaks the tie once and the jobs then alternate on their own, as on the emulated cluster.
    fair = simulate_small(0.05, 0.05, 2, "passthrough", link_sharing="fair")
    fifo = simulate_small(0.05, 0.05, 2, "passthrough", link_sharing="fifo")
    assert fair["bound_fraction"] < 0.6
    assert fifo["bound_fraction"] > 0.9
    with pytest.raises(ValueError, match="link_sharing"):
        simulate([job("a")], "exclusive", n_nodes=2, config=SimConfig(link_sharing="lifo"))


def test_fifo_links_never_deadlock_jobs_that_share_different_links():
    # a spans nodes 0-1, b spans 1-2, c spans 0 and 2: every pair shares one link, in some order.
    jobs = [JobSpec(name, place, 0.01, 0.03, iterations=40, jitter=0.2)
            for name, place in (("a", ((0, 0), (1, 0))), ("b", ((1, 0), (2, 0))), ("c", ((0, 0), (2, 0))))]
    res = simulate(jobs, "passthrough", n_nodes=3, config=SimConfig(link_sharing="fifo", seed=4))
    assert all(j.iterations >= 40 for j in res.jobs)


@pytest.mark.parametrize("x", [0.25, 1.0])
def test_interference_stretches_only_the_overlapped_parts_of_phases(x):
    # Alone, a job's compute and allreduce never overlap on a device: nothing changes.
    cfg = SimConfig(interference=x, warmup_iterations=0)
    alone = simulate([job("a", iters=30)], "crossover", n_nodes=2, config=cfg)
    assert alone.jobs[0].iter_per_s == pytest.approx(1 / (C + M), rel=1e-9)
    # Two jobs with C = M in perfect alternation: every phase overlaps another job's phase on its
    # device for its whole length, so each takes (1 + x) times longer: the bound over 1 + x.
    jobs = [job("a", m=C, iters=120), job("b", m=C, iters=120)]
    clean = simulate(jobs, "crossover", n_nodes=2, config=SimConfig(seed=2))
    slowed = simulate(jobs, "crossover", n_nodes=2, config=SimConfig(seed=2, interference=x))
    assert clean.bound_fraction > 0.95
    assert slowed.bound_fraction == pytest.approx(clean.bound_fraction / (1 + x), rel=0.03)
    # Unscheduled sharing of the device itself is processor sharing, not interference: compute
    # phases that overlap each other are not stretched by it (and lockstep jobs never overlap
    # their compute with an allreduce under fair links).
    pt = [simulate(jobs, "passthrough", n_nodes=2, config=SimConfig(seed=2, interference=v)) for v in (0.0, x)]
    assert pt[1].throughput_iter_s == pytest.approx(pt[0].throughput_iter_s, rel=0.05)


def test_a_rank_asked_to_yield_hands_its_device_back_after_yield_s_and_finishes_its_phase_later():
    """A low job whose 0.2 s phases fit no 50 ms gap of a high job: with yields modelled, its phases are cut
    into the gaps (`ClassSettings.cut_turns`) and the high job waits at most about `yield_s` for the device;
    without, the policy learns that asks end at the phase's end and the high job waits for whole phases."""
    jobs = [job("hi", iters=None, priority="high"), job("lo", c=0.2, m=0.01, iters=None, priority="low")]
    waits, spans = {}, {}
    for ys in (None, 0.002):
        res = simulate(jobs, "crossover", n_nodes=2, config=SimConfig(yield_s=ys, record_trace=True, horizon_s=30.0))
        no_overlap(res.trace)
        waits[ys] = next(j for j in res.jobs if j.name == "hi").grant_wait_max_s
        lo = [s for s in res.trace if s.job == "lo" and s.node == 0]
        spans[ys] = (len(lo), len({s.iteration for s in lo}), sum(s.end - s.start for s in lo))
    count, iterations, held = spans[0.002]
    assert count > 2 * iterations > 0  # each phase in several gaps
    assert held == pytest.approx(0.2 * iterations, rel=0.1)  # no work lost to a yield
    assert waits[0.002] < 0.01 < 0.1 < waits[None]
    assert spans[None][0] == spans[None][1]  # never cut: a span per phase
