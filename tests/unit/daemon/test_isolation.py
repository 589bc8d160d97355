"""The isolation controller (`policies.isolation`) driven with explicit times, and the `crossover` policy
enforcing its budget: solo windows for the reference, AIMD on the budget, aligned windows, and equal classes
left alone."""
from __future__ import annotations

import math

import pytest

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies import CrossoverPolicy
from crossover.daemon.policies.classes import ClassSettings, JobClass, Priority
from crossover.daemon.policies.isolation import IsolationController, IsolationSettings, Window

PROD, LOW = frozenset({"prod"}), frozenset({"sweep"})


def _run(ctl: IsolationController, t0: float, t1: float, iteration_s: float, start: int = 0) -> int:
    """`prod` asks for an iteration every `iteration_s` from `t0` to `t1`, the controller stepped at each;
    returns the next iteration number."""
    i, t = start, t0
    while t < t1:
        ctl.step(PROD, LOW, t)
        ctl.request("prod", i, t)
        i, t = i + 1, t + iteration_s
    return i


def test_settings_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="target"):
        IsolationSettings(target=1.5)
    with pytest.raises(ValueError, match="decrease"):
        IsolationSettings(decrease=1.0)
    assert not IsolationSettings(target=0).on


def test_the_first_window_is_solo_and_measures_the_reference():
    ctl = IsolationController(IsolationSettings(window_s=1.0, settle_share=0.25))
    change = ctl.step(PROD, LOW, 0.0)
    assert change is not None and change.window is Window.SOLO and ctl.allowed() == 0.0
    assert not ctl.allows(0.0, 0.01, starving=True)  # a solo window is solo
    i = _run(ctl, 0.0, 1.0, 0.1)
    change = ctl.step(PROD, LOW, 1.0)
    assert ctl.window is Window.SHARED and ctl.reference_s["prod"] == pytest.approx(0.1)
    assert change is not None and "alone" in change.reason and change.reference_s == pytest.approx(0.1)
    assert ctl.allowed() == pytest.approx(0.1)
    assert ctl.allows(0.05, 0.05, starving=False) and not ctl.allows(0.05, 0.06, starving=False)
    assert ctl.allows(0.0, 0.5, starving=True)  # nothing held for a while: one phase, whatever the budget
    _run(ctl, 1.0, 2.0, 0.1, i)


def test_the_budget_rises_while_the_protected_job_keeps_its_pace_and_halves_when_it_does_not():
    s = IsolationSettings(window_s=1.0, initial=0.1, increase=0.05, decrease=0.5, solo_every=100, smooth_windows=1,
                          slow_start=False)
    ctl = IsolationController(s)
    i = _run(ctl, 0.0, 1.0, 0.1)  # solo
    i = _run(ctl, 1.0, 2.0, 0.1, i)  # shared, as fast as alone
    ctl.step(PROD, LOW, 2.0)
    assert ctl.budget == pytest.approx(0.15) and ctl.kept() == pytest.approx(1.0)
    i = _run(ctl, 2.0, 3.0, 0.12, i)  # 0.83x of alone: far below 0.97, halved
    change = ctl.step(PROD, LOW, 3.0)
    assert ctl.budget == pytest.approx(0.075)
    assert change is not None and "less" in change.reason and change.current_s == pytest.approx(0.12)
    i = _run(ctl, 3.0, 4.0, 0.1 / 0.96, i)  # 0.96x: a percent short, trimmed by cut_gain percent
    ctl.step(PROD, LOW, 4.0)
    assert ctl.budget == pytest.approx(0.075 * (1 - s.cut_gain * 0.01 / 0.97), rel=1e-3)


def test_a_judgement_pools_the_last_windows_so_one_slow_window_of_jitter_neither_cuts_nor_raises():
    s = IsolationSettings(window_s=1.0, initial=0.1, increase=0.05, solo_every=100, smooth_windows=3,
                          slow_start=False)
    ctl = IsolationController(s)
    i = _run(ctl, 0.0, 1.0, 0.1)  # solo
    i = _run_steps(ctl, 1.0, 2.0, (0.08, 0.12), i)  # shared, as fast as alone but too jittery to be sure
    ctl.step(PROD, LOW, 2.0)
    assert ctl.budget == pytest.approx(0.1)
    i = _run_steps(ctl, 2.0, 3.0, (0.09, 0.125), i)  # 0.93x on its own, 0.96x pooled: short within its noise
    ctl.step(PROD, LOW, 3.0)
    assert ctl.budget == pytest.approx(0.1)
    i = _run_steps(ctl, 3.0, 4.0, (0.08, 0.12), i)  # three windows pooled read above 0.97: raised
    ctl.step(PROD, LOW, 4.0)
    assert ctl.budget == pytest.approx(0.15)
    i = _run(ctl, 4.0, 5.0, 0.125, i)  # 0.8x, judged on its own (a raise starts a new pool): surely short, cut
    ctl.step(PROD, LOW, 5.0)
    assert ctl.budget < 0.15
    cut = ctl.budget
    i = _run(ctl, 5.0, 6.0, 0.1, i)  # the pool starts after the cut: this window alone, surely at its reference
    ctl.step(PROD, LOW, 6.0)
    assert ctl.budget == pytest.approx(cut + 0.05)


def _run_steps(ctl: IsolationController, t0: float, t1: float, steps: tuple[float, ...], start: int = 0) -> int:
    """As `_run`, the iterations taking `steps` in turn (a jittery job)."""
    i, t = start, t0
    while t < t1:
        ctl.step(PROD, LOW, t)
        ctl.request("prod", i, t)
        t += steps[i % len(steps)]
        i += 1
    return i


def test_the_budget_doubles_until_the_first_cut_and_again_after_the_jobs_change():
    ctl = IsolationController(IsolationSettings(window_s=1.0, initial=0.1, increase=0.05, solo_every=100))
    i = _run(ctl, 0.0, 1.0, 0.1)  # solo
    budgets = []
    for w in range(1, 4):  # as fast as alone
        i = _run(ctl, float(w), w + 1.0, 0.1, i)
        ctl.step(PROD, LOW, w + 1.0)
        budgets.append(ctl.budget)
    assert budgets == pytest.approx([0.2, 0.4, 0.8])
    i = _run(ctl, 4.0, 5.0, 0.11, i)  # 0.91x alone, every iteration alike: surely short, cut
    ctl.step(PROD, LOW, 5.0)
    cut = ctl.budget
    assert cut < 0.8
    i = _run(ctl, 5.0, 6.0, 0.1, i)  # past the first cut: additive again
    ctl.step(PROD, LOW, 6.0)
    assert ctl.budget == pytest.approx(cut + 0.05)
    both = frozenset({"sweep", "other"})  # a second lower job: measured alone, then slow start again
    budgets = []
    for w in range(6, 10):
        t = float(w)
        while t < w + 1.0:
            ctl.step(PROD, both, t)
            ctl.request("prod", i, t)
            i, t = i + 1, t + 0.1
        ctl.step(PROD, both, w + 1.0)
        budgets.append(ctl.budget)
    assert budgets[0] == pytest.approx(cut + 0.05)  # the solo window
    assert budgets[1:] == pytest.approx([min(1.0, 2 ** k * (cut + 0.05)) for k in (1, 2, 3)])


def test_slow_start_doubles_on_a_window_within_the_target_and_only_a_sure_margin_raises_after_the_first_cut():
    ctl = IsolationController(IsolationSettings(window_s=1.0, initial=0.1, solo_every=100, smooth_windows=4))
    jitter = (0.08, 0.12)  # as fast as alone on average, too jittery for one window to be sure of a margin
    i = _run_steps(ctl, 0.0, 1.0, jitter)  # solo
    budgets = []
    for w in range(1, 3):
        i = _run_steps(ctl, float(w), w + 1.0, jitter, i)
        ctl.step(PROD, LOW, w + 1.0)
        budgets.append(ctl.budget)
    assert budgets == pytest.approx([0.2, 0.4])  # slow start: each window within the target doubles it
    i = _run(ctl, 3.0, 4.0, 0.125, i)  # 0.8x, surely short: cut, and slow start ends
    ctl.step(PROD, LOW, 4.0)
    cut = ctl.budget
    assert cut < 0.4
    for w in range(4, 7):
        i = _run_steps(ctl, float(w), w + 1.0, jitter, i)
        ctl.step(PROD, LOW, w + 1.0)
        assert ctl.budget == pytest.approx(cut)  # within its noise: held while the pool fills
    i = _run_steps(ctl, 7.0, 8.0, jitter, i)
    ctl.step(PROD, LOW, 8.0)
    assert ctl.budget == pytest.approx(cut + 0.05)  # the pool full and within the target: raised by a step


def test_a_reading_short_within_its_jitter_holds_the_budget_until_the_pool_is_full_then_cuts():
    s = IsolationSettings(window_s=1.0, initial=0.2, solo_every=100, smooth_windows=3)
    ctl = IsolationController(s)
    jitter = (0.08, 0.12)  # 0.1 s on average, each iteration 20 % off it
    i = _run_steps(ctl, 0.0, 1.0, jitter)  # solo
    ctl.step(PROD, LOW, 1.0)
    assert ctl.reference_s["prod"] == pytest.approx(0.1, rel=0.05)
    slow = tuple(x * 1.04 for x in jitter)  # 0.96x alone, within a few iterations' jitter
    budgets = []
    for w in range(1, 4):
        i = _run_steps(ctl, float(w), w + 1.0, slow, i)
        ctl.step(PROD, LOW, w + 1.0)
        budgets.append(ctl.budget)
    assert budgets[:2] == [0.2, 0.2]  # held: not raised, not cut
    assert budgets[2] < 0.2  # the pool full and still short: cut, by the shortfall
    assert budgets[2] > 0.2 * s.decrease


def test_a_reading_short_beyond_its_jitter_cuts_at_once():
    ctl = IsolationController(IsolationSettings(window_s=1.0, initial=0.2, solo_every=100, smooth_windows=4))
    i = _run(ctl, 0.0, 1.0, 0.1)  # solo, steady
    i = _run(ctl, 1.0, 2.0, 0.11, i)  # 0.91x alone, every iteration alike: surely short
    ctl.step(PROD, LOW, 2.0)
    assert ctl.budget < 0.2
    jittery = IsolationController(IsolationSettings(window_s=1.0, initial=0.2, solo_every=100, smooth_windows=4))
    i = _run_steps(jittery, 0.0, 1.0, (0.05, 0.15))  # the same mean, each iteration 50 % off it
    i = _run_steps(jittery, 1.0, 2.0, (0.055, 0.165), i)
    jittery.step(PROD, LOW, 2.0)
    assert jittery.budget == 0.2  # the same shortfall within so much jitter: one window is not enough


def test_a_solo_run_over_several_windows_is_one_measurement_of_the_reference():
    ctl = IsolationController(IsolationSettings(window_s=1.0, settle_share=0.0, max_solo=3, reference_windows=3))
    two = frozenset({"prod", "slow"})
    for k in range(40):  # prod every 0.1 s; `slow`, also protected, every 1.3 s keeps the solo run going
        t = 0.1 * k
        ctl.step(two, LOW, t)
        ctl.request("prod", k, t)
        if k % 13 == 0:
            ctl.request("slow", k // 13, t)
    ctl.step(two, LOW, 4.0)
    assert ctl.window is Window.SHARED and len(ctl._solos["prod"]) == 1
    assert ctl._solos["prod"][0].steps == ctl._solos["prod"][0].iterations


def test_the_reference_pools_the_latest_solo_windows():
    def reference(windows: int) -> float:
        ctl = IsolationController(IsolationSettings(window_s=1.0, solo_every=1, reference_windows=windows))
        i = _run(ctl, 0.0, 1.0, 0.1)  # solo
        i = _run(ctl, 1.0, 2.0, 0.1, i)  # shared
        _run(ctl, 2.0, 3.0, 0.125, i)  # solo again, slower
        ctl.step(PROD, LOW, 3.0)
        return ctl.reference_s["prod"]

    assert reference(1) == pytest.approx(0.125)
    assert 0.105 < reference(3) < 0.12  # both solo windows, by their iterations


def test_a_solo_window_comes_back_every_solo_every_windows_and_when_the_jobs_change():
    ctl = IsolationController(IsolationSettings(window_s=1.0, solo_every=3))
    i = _run(ctl, 0.0, 1.0, 0.1)
    kinds = []
    for w in range(1, 6):
        i = _run(ctl, float(w), w + 1.0, 0.1, i)
        kinds.append(ctl.window)
    assert kinds == [Window.SHARED, Window.SHARED, Window.SHARED, Window.SOLO, Window.SHARED]
    change = ctl.step(PROD, frozenset({"sweep", "other"}), 6.5)
    assert change is not None and ctl.window is Window.SOLO and "changed" in change.reason


def test_windows_are_aligned_on_the_wall_clock_so_every_node_measures_alike():
    node_a = IsolationController(IsolationSettings(window_s=2.0), offset=1000.0)
    node_b = IsolationController(IsolationSettings(window_s=2.0), offset=1000.5)  # another monotonic origin
    assert node_a.next_boundary(1.0) + 1000.0 == node_b.next_boundary(0.5) + 1000.5 == 1002.0


def test_a_job_without_a_reference_is_measured_alone_over_a_few_windows_then_shared_until_the_next_slot():
    ctl = IsolationController(IsolationSettings(window_s=1.0, max_solo=3, solo_every=15))
    ctl.step(PROD, LOW, 0.0)
    ctl.request("prod", 0, 0.5)  # one boundary, then the job pauses
    kinds = []
    for w in range(1, 5):
        change = ctl.step(PROD, LOW, float(w))
        kinds.append(ctl.window)
    assert kinds == [Window.SOLO, Window.SOLO, Window.SHARED, Window.SHARED] and not ctl.reference_s
    assert change is None or "did not run alone" in change.reason
    for w in range(5, 16):
        ctl.step(PROD, LOW, float(w))
    assert ctl.window is Window.SHARED
    ctl.step(PROD, LOW, 16.0)
    assert ctl.window is Window.SOLO  # the next slot on the wall clock: every node's


def test_a_job_whose_iteration_outlasts_a_window_is_measured_over_consecutive_solo_windows():
    ctl = IsolationController(IsolationSettings(window_s=1.0, settle_share=0.0, max_solo=3))
    i = _run(ctl, 0.0, 3.5, 1.5)  # boundaries at 0, 1.5, 3.0
    ctl.step(PROD, LOW, 3.5)
    assert ctl.reference_s["prod"] == pytest.approx(1.5) and ctl.window is Window.SHARED
    _run(ctl, 3.5, 5.0, 1.5, i)


def test_periodic_solo_windows_fall_on_the_same_wall_clock_windows_on_every_node():
    def solos(offset: float) -> list[int]:
        ctl = IsolationController(IsolationSettings(window_s=1.0, solo_every=3), offset=offset)
        i, out = 0, []
        for k in range(60):
            t = 0.1 * k
            ctl.step(PROD, LOW, t)
            ctl.request("prod", i, t)
            i += 1
            if ctl.window is Window.SOLO:
                out.append(math.floor(t + offset))
        return sorted(set(out))

    a, b = solos(1000.0), solos(1000.3)  # two nodes, clocks 0.3 s apart at start
    assert [w for w in a if w > 1001] == [w for w in b if w > 1001]  # past the first measurement, in step


# ---- the policy enforces the budget ------------------------------------------------------------------


def _ref(job: str) -> RankRef:
    return RankRef(RankKey(job, 0), job_name=job, device=0, world_size=1, joined_at=0.0)


def _policy(**isolation: float) -> CrossoverPolicy:
    p = CrossoverPolicy(classes=ClassSettings(guard_share=0.0001, isolation=IsolationSettings(**isolation)))
    for job, cls in (("prod", JobClass(Priority.NORMAL)), ("sweep", JobClass(Priority.LOW))):
        p.join(_ref(job), 0.0)
        p.classify(job, cls, 0.0)
    return p


def _prod_iteration(p: CrossoverPolicy, i: int, t: float, compute: float = 0.05) -> None:
    assert p.request(RankKey("prod", 0), i, t) == [RankKey("prod", 0)], f"prod waited at {t}"
    p.observe(RankKey("prod", 0), "compute", compute, t + compute)
    p.release(RankKey("prod", 0), t + compute)


def test_a_lower_phase_waits_out_the_solo_window_and_then_gets_its_budget():
    p = _policy(window_s=1.0, settle_share=0.0, initial=0.2)
    sweep = RankKey("sweep", 0)
    for i in range(10):  # solo: prod every 0.1 s, sweep asks in the middle of it and is held back
        _prod_iteration(p, i, 0.1 * i)
        if i == 3:
            assert p.request(sweep, 0, 0.36) == []
    assert p.decisions()["budget"] >= 1 and p.isolating(0)
    assert p.next_deadline() is not None and p.next_deadline() <= 1.0
    granted = p.tick(1.0)  # the shared window: within the budget, into prod's gap
    assert granted == [sweep]
    changes = p.take_isolation_changes()
    assert [c.window.value for _, c in changes] == ["solo", "shared"]
    assert changes[-1][1].reference_s == pytest.approx(0.1)


def test_the_budget_caps_the_lower_classes_device_time():
    p = _policy(window_s=1.0, settle_share=0.0, initial=0.1)
    sweep = RankKey("sweep", 0)
    for i in range(10):
        _prod_iteration(p, i, 0.1 * i)
    p.tick(1.0)
    assert p.request(sweep, 0, 1.0) == [sweep]
    p.observe(sweep, "compute", 0.12, 1.12)
    p.release(sweep, 1.12)  # 0.12 s held: over 0.1 s per 1 s window
    assert p.request(sweep, 1, 1.2) == []
    assert p.decisions()["budget"] >= 1


def test_equal_classes_and_a_protect_of_zero_leave_the_device_alone():
    p = _policy(target=0.0)
    assert p.request(RankKey("sweep", 0), 0, 0.0) == [RankKey("sweep", 0)]
    assert not p.isolating(0) and p.take_isolation_changes() == []
    q = CrossoverPolicy()
    for job in ("a", "b"):
        q.join(_ref(job), 0.0)
    assert q.request(RankKey("a", 0), 0, 0.0) == [RankKey("a", 0)]
    assert not q.isolating(0)


def _sweep_after_a_solo_window() -> tuple[CrossoverPolicy, RankKey]:
    """A device whose budget (0.01 s/s) a lower job's 0.3 s phase overruns, its first solo window measured."""
    p = _policy(window_s=1.0, settle_share=0.0, initial=0.01, starve_windows=4)
    for i in range(10):
        _prod_iteration(p, i, 0.1 * i)
    p.tick(1.0)
    return p, RankKey("sweep", 0)


def test_a_lower_job_over_its_budget_still_gets_a_phase_after_starve_windows_without_one():
    p, sweep = _sweep_after_a_solo_window()
    assert p.request(sweep, 0, 1.0) == [sweep]  # nothing held for four windows: one phase
    p.observe(sweep, "compute", 0.3, 1.3)
    p.release(sweep, 1.3)
    assert p.request(sweep, 1, 1.35) == []  # 0.3 s held, 0.01 s/s allowed
    granted = []
    t = 1.4
    while not granted and t < 8.0:
        granted = p.tick(t)
        t += 0.1
    assert granted == [sweep] and t - 0.1 >= 1.3 + 4 * 1.0 - 1e-9, f"granted at {t - 0.1:.1f}"


def test_the_reference_is_never_slower_than_the_pace_before_any_lower_job_came():
    p = CrossoverPolicy(classes=ClassSettings(guard_share=0.0001, isolation=IsolationSettings(window_s=1.0,
                                                                                               settle_share=0.0)))
    p.join(_ref("prod"), 0.0)
    p.classify("prod", JobClass(Priority.NORMAL), 0.0)
    for i in range(10):  # alone: 0.1 s an iteration
        _prod_iteration(p, i, 0.1 * i)
    p.join(_ref("sweep"), 1.0)
    p.classify("sweep", JobClass(Priority.LOW), 1.0)
    for i in range(10, 20):  # its solo window: the idle lower job's processes slow it to 0.12 s
        _prod_iteration(p, i, 1.0 + 0.12 * (i - 10))
    p.tick(2.3)
    assert p.isolation[0].reference_s["prod"] == pytest.approx(0.1)


def test_each_device_counts_only_the_lower_time_held_on_it():
    p = CrossoverPolicy(classes=ClassSettings(guard_share=0.0001, isolation=IsolationSettings(
        window_s=1.0, settle_share=0.0, initial=0.2)))
    for job, cls in (("prod", JobClass(Priority.NORMAL)), ("sweep", JobClass(Priority.LOW))):
        for dev in (0, 1):
            p.join(RankRef(RankKey(job, dev), job_name=job, device=dev, world_size=2, joined_at=0.0), 0.0)
        p.classify(job, cls, 0.0)
    for i in range(10):  # solo on both devices
        for dev in (0, 1):
            assert p.request(RankKey("prod", dev), i, 0.1 * i) == [RankKey("prod", dev)]
            p.release(RankKey("prod", dev), 0.1 * i + 0.05)
    p.tick(1.0)
    assert p.request(RankKey("sweep", 1), 0, 1.0) == [RankKey("sweep", 1)]
    p.observe(RankKey("sweep", 1), "compute", 0.15, 1.15)
    p.release(RankKey("sweep", 1), 1.15)  # 0.15 s on device 1; another 0.15 s fits 0.2 s on device 0, not on 1
    assert p.request(RankKey("sweep", 0), 0, 1.2) == [RankKey("sweep", 0)]
    assert p.request(RankKey("sweep", 1), 1, 1.2) == []


def test_the_floor_serves_a_starving_lower_rank_even_where_no_gap_fits_it():
    p, sweep = _sweep_after_a_solo_window()
    assert p.request(sweep, 0, 1.0) == [sweep]  # its first phase: 0.3 s, which no gap of prod's fits
    p.observe(sweep, "compute", 0.3, 1.3)
    p.release(sweep, 1.3)
    assert p.request(sweep, 1, 1.3) == []
    t, i, granted = 1.3, 10, []
    while t < 8.0 and not granted:  # prod never stops: 95 ms of compute, a 5 ms gap
        assert p.request(RankKey("prod", 0), i, t) == [RankKey("prod", 0)]
        p.observe(RankKey("prod", 0), "compute", 0.095, t + 0.095)
        granted = p.release(RankKey("prod", 0), t + 0.095)
        if i > 10:
            p.observe(RankKey("prod", 0), "comm", 0.005, t)  # the allreduce before this iteration
        granted += p.tick(t + 0.097)
        t, i = t + 0.1, i + 1
    assert granted == [sweep] and t >= 1.3 + 4.0, f"granted at {t:.1f}"
    assert p.decisions()["floor"] == 1
    assert p.request(RankKey("prod", 0), i, t) == []  # prod back: it waits out the floor's whole phase
    assert p.take_preemptions() == []



def test_the_floor_counts_from_the_first_ask_of_an_iteration_whatever_asks_came_between():
    """A lower rank that asks again for the iteration it waits for (after a yield, or a withdrawn request) is
    owed its floor 4 s after it first asked for it: asking again does not restart the wait."""
    p, sweep = _sweep_after_a_solo_window()
    assert p.request(sweep, 0, 1.0) == [sweep]
    p.observe(sweep, "compute", 0.3, 1.3)
    p.release(sweep, 1.3)
    assert p.request(sweep, 1, 1.3) == []  # iteration 1, first asked at 1.3
    t, i, granted = 1.3, 10, []
    while t < 8.0 and not granted:
        assert p.request(RankKey("prod", 0), i, t) == [RankKey("prod", 0)]
        p.observe(RankKey("prod", 0), "compute", 0.095, t + 0.095)
        if 2.0 <= t < 2.1:  # it stops waiting and asks again for the same iteration
            p.cancel(sweep, t + 0.09)
            assert p.request(sweep, 1, t + 0.09) == []
        granted = p.release(RankKey("prod", 0), t + 0.095)
        if i > 10:
            p.observe(RankKey("prod", 0), "comm", 0.005, t)
        granted += p.tick(t + 0.097)
        t, i = t + 0.1, i + 1
    assert granted == [sweep] and 1.3 + 4.0 <= t < 1.3 + 4.3, f"granted at {t:.1f}"
    assert p.decisions()["floor"] == 1
