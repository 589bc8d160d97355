"""The class rules of the `crossover` policy (`policies.classes`), driven directly with explicit `now` values.

Row by row: higher first, a yield asked of a lower holder, lower phases only into gaps
they fit, an overdue higher job opening its gap, the guard, weights. Then properties over
random event sequences: equal classes change nothing; a high rank never waits behind a
low phase that started after it asked; two nodes fed the same events decide alike.
"""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies import CrossoverPolicy
from crossover.daemon.policies.classes import ClassBook, ClassSettings, JobClass, Priority
from crossover.daemon.policies.isolation import IsolationSettings

HIGH, NORMAL, LOW = JobClass(Priority.HIGH), JobClass(Priority.NORMAL), JobClass(Priority.LOW)


def ref(job: str, rank: int = 0, device: int = 0) -> RankRef:
    return RankRef(RankKey(job, rank), job_name=job, device=device, world_size=2, joined_at=0.0)


def K(job: str, rank: int = 0) -> RankKey:  # noqa: N802 - reads like the RankKey it builds
    return RankKey(job, rank)


def policy(classes: dict[str, JobClass], **settings: float) -> CrossoverPolicy:
    """The open-loop rules alone: the isolation controller over them is `test_isolation.py`'s."""
    p = CrossoverPolicy(classes=ClassSettings(**settings, isolation=IsolationSettings(target=0.0)))
    for job, cls in classes.items():
        p.join(ref(job), 0.0)
        p.classify(job, cls, 0.0)
    return p


def phase(p: CrossoverPolicy, job: str, t0: float, compute: float, comm: float) -> None:
    """One full phase of `job` alone on the device: request, grant, release at t0 + compute; its allreduce measured."""
    assert p.request(K(job), 0, t0) == [K(job)]
    p.observe(K(job), "compute", compute, t0 + compute)
    p.release(K(job), t0 + compute)
    p.observe(K(job), "comm", comm, t0 + compute + comm)


def test_priority_parses_its_three_names_and_refuses_others() -> None:
    assert [Priority.parse(x) for x in ("HIGH", " normal", "low")] == [Priority.HIGH, Priority.NORMAL, Priority.LOW]
    with pytest.raises(ValueError, match="high, normal, low"):
        Priority.parse("urgent")
    with pytest.raises(ValueError, match="weight"):
        JobClass(Priority.LOW, 0.0)
    assert str(JobClass(Priority.LOW, 2.0)) == "low x2" and str(NORMAL) == "normal"


def test_the_gap_margin_takes_a_bounded_share_or_inf_for_any_gap() -> None:
    with pytest.raises(ValueError, match="0.5..2"):
        ClassSettings(fit_margin=3.0)
    for margin, granted in ((1.2, []), (math.inf, [K("lo")])):  # inf: `bench.priority --rules`, the rule off
        p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001, fit_margin=margin, cut_turns=False)
        phase(p, "lo", 0.0, compute=0.3, comm=0.1)
        phase(p, "hi", 1.0, compute=0.1, comm=0.2)
        assert p.request(K("lo"), 1, 1.15) == granted  # 0.3 s into a gap of 0.15 s


def test_the_guard_serves_a_phase_longer_than_it_can_save_up_once_its_credit_is_full() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.02, guard_window_s=10.0)  # saves up 0.2 s at most
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)  # credit now -0.3 s: full again 25 s later
    t, i, served = 0.4, 1, None
    while t < 40.0 and served is None:  # hi never leaves a gap: 95 ms of compute, back 5 ms after
        if p.request(K("hi"), i, t) != [K("hi")]:
            served = t  # lo holds the device: hi waits
            break
        if i == 4:  # hi's gaps measured: 5 ms
            assert p.request(K("lo"), 1, t) == []
        p.observe(K("hi"), "compute", 0.095, t + 0.095)
        if p.release(K("hi"), t + 0.095) == [K("lo")]:
            served = t + 0.095
        p.observe(K("hi"), "comm", 0.005, t + 0.1)
        t, i = t + 0.1, i + 1
    assert served is not None and 25.0 <= served <= 26.0, served


def test_a_waiting_high_rank_goes_before_a_low_one_that_asked_first() -> None:
    p = policy({"hi": HIGH, "lo": LOW, "x": NORMAL})
    p.request(K("x"), 0, 0.0)  # x holds; lo then hi queue
    p.request(K("lo"), 0, 0.1)
    p.request(K("hi"), 0, 0.2)
    assert p.release(K("x"), 0.3) == [K("hi")]


def test_a_high_request_asks_the_low_holder_to_yield_once_and_is_served_next() -> None:
    p = policy({"hi": HIGH, "lo": LOW, "lo2": LOW})
    assert p.request(K("lo"), 0, 0.0) == [K("lo")]
    p.request(K("lo2"), 0, 0.05)
    assert p.request(K("hi"), 0, 0.1) == []
    assert p.take_preemptions() == [K("lo")] and p.take_preemptions() == []
    assert p.release(K("lo"), 0.12) == [K("hi")]  # the yield: hi, not lo2
    assert p.decisions()["preempt"] == 1


def test_a_low_holder_about_to_release_is_not_asked_to_yield() -> None:
    p = policy({"hi": HIGH, "lo": LOW})
    phase(p, "lo", 0.0, compute=0.2, comm=0.1)  # lo's phases take 0.2 s
    assert p.request(K("lo"), 1, 1.0) == [K("lo")]
    p.request(K("hi"), 0, 1.19)  # 10 ms of lo's phase left: not worth a hand-over
    assert p.take_preemptions() == []
    p.release(K("lo"), 1.2)
    p.release(K("hi"), 1.3)
    p.request(K("lo"), 2, 1.3)
    p.request(K("hi"), 1, 1.35)  # 150 ms left: yield
    assert p.take_preemptions() == [K("lo")]


def test_equal_class_requests_ask_nobody_to_yield() -> None:
    p = policy({"a": LOW, "b": LOW})
    p.request(K("a"), 0, 0.0)
    p.request(K("b"), 0, 0.1)
    assert p.take_preemptions() == []


def test_a_low_phase_waits_for_a_gap_it_fits_and_the_deadline_looks_again() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001, cut_turns=False)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)  # lo's phase is 0.3 s
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)  # hi left at 1.1 and is due back at 1.3
    assert p.request(K("lo"), 1, 1.15) == []  # 0.15 s left: 0.3 s does not fit
    assert p.decisions()["held_back"] == 1
    assert p.next_deadline() == pytest.approx(1.3 + 0.2 + 1e-3)  # hi overdue by its allreduce: the gap opens
    assert p.tick(1.4) == []
    assert p.tick(1.502) == [K("lo")]


def test_a_low_phase_that_fits_the_gap_is_granted_at_once() -> None:
    p = policy({"hi": HIGH, "lo": LOW})
    phase(p, "lo", 0.0, compute=0.05, comm=0.1)
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)
    assert p.request(K("lo"), 1, 1.12) == [K("lo")]


def test_the_high_job_back_in_time_is_served_and_the_low_one_waits() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001, cut_turns=False)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)
    p.request(K("lo"), 1, 1.15)
    assert p.request(K("hi"), 1, 1.3) == [K("hi")]


def cut_turn(p: CrossoverPolicy, iteration: int, t: float) -> tuple[float, list[RankKey]]:
    """hi leaves for its 0.2 s allreduce at t + 0.1; lo (0.3 s phases) asks 50 ms into the gap. Returns when
    the policy asks lo to yield, and what it asks."""
    assert p.request(K("hi"), iteration, t) == [K("hi")]
    p.observe(K("hi"), "compute", 0.1, t + 0.1)
    p.release(K("hi"), t + 0.1)
    p.observe(K("hi"), "comm", 0.2, t + 0.3)
    assert p.request(K("lo"), iteration, t + 0.15) == [K("lo")]  # 0.3 s into 0.15 s left: cut to it
    cut_at = p.next_deadline()
    assert cut_at is not None
    assert p.tick(cut_at - 1e-4) == [] and p.take_preemptions() == []
    p.tick(cut_at)
    return cut_at, p.take_preemptions()


def test_a_low_phase_that_does_not_fit_is_cut_to_the_gap_and_asked_to_yield_as_it_closes() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)
    cut_at, asked = cut_turn(p, 2, 1.3)
    assert asked == [K("lo")] and cut_at == pytest.approx(1.6)  # hi back at 1.4 + 0.2: no lead measured yet
    assert p.decisions()["cut"] == 1 and p.decisions()["held_back"] == 0
    assert p.request(K("hi"), 3, 1.6) == []  # back as asked: it waits for the yield, not the phase
    assert p.release(K("lo"), 1.61) == [K("hi")]
    assert p.request(K("lo"), 2, 1.61) == []  # the rest of its phase waits for the next gap
    assert p.take_preemptions() == []  # asked once a grant


def test_the_cut_comes_earlier_by_how_long_the_job_took_to_yield() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    t = 1.0
    for i in range(1, 4):
        cut_at, asked = cut_turn(p, i, t)
        assert asked == [K("lo")]
        assert cut_at == pytest.approx(t + 0.3 - (0.0 if i == 1 else 0.02))
        p.release(K("lo"), cut_at + 0.02)  # 20 ms after the ask
        p.request(K("lo"), i, cut_at + 0.02)  # the same iteration again: a yield
        p.cancel(K("lo"), cut_at + 0.021)
        t = cut_at + 0.1


def test_a_job_that_finishes_its_phase_instead_of_yielding_is_held_back_instead() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    t = 1.0
    for i in range(1, 3):  # asked twice, it answers each time at its phase's end (work without gradients)
        cut_at, asked = cut_turn(p, i, t)
        assert asked == [K("lo")]
        p.release(K("lo"), t + 0.45)
        p.request(K("lo"), i + 10, t + 0.45)  # its next iteration: it did not yield
        p.cancel(K("lo"), t + 0.451)
        t += 1.0
    assert p.request(K("hi"), 3, t) == [K("hi")]
    p.observe(K("hi"), "compute", 0.1, t + 0.1)
    p.release(K("hi"), t + 0.1)
    held_back = p.decisions()["held_back"]
    assert p.request(K("lo"), 13, t + 0.15) == []
    assert p.decisions()["held_back"] == held_back + 1 and p.decisions()["cut"] == 2
    p.cancel(K("lo"), t + 0.2)
    t += 60.0  # and stays so: each ask would cost the higher job an overrun
    assert p.request(K("hi"), 4, t) == [K("hi")]
    p.release(K("hi"), t + 0.1)
    assert p.request(K("lo"), 14, t + 0.15) == [] and p.decisions()["cut"] == 2


def test_a_rank_that_yielded_is_not_granted_back_beside_its_jobs_other_rank_while_a_higher_one_waits() -> None:
    p = policy({"hi": HIGH}, guard_share=0.0001)
    for r in (0, 1):
        p.join(ref("lo", r), 0.0)
    p.classify("lo", LOW, 0.0)
    assert p.request(K("lo", 0), 0, 0.0) == [K("lo", 0)]
    assert p.request(K("lo", 1), 0, 0.0) == [K("lo", 1)]  # its mate, beside it
    assert p.request(K("hi"), 0, 0.01) == []
    assert sorted(p.take_preemptions()) == [K("lo", 0), K("lo", 1)]
    assert p.release(K("lo", 0), 0.02) == []
    assert p.request(K("lo", 0), 0, 0.02) == []  # asks again for the same iteration: waits behind hi
    assert p.release(K("lo", 1), 0.03) == [K("hi")]


def test_a_cut_turn_whose_higher_job_left_is_not_asked_to_yield() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)
    assert p.request(K("hi"), 1, 1.3) == [K("hi")]
    p.observe(K("hi"), "compute", 0.1, 1.4)
    p.release(K("hi"), 1.4)
    assert p.request(K("lo"), 1, 1.45) == [K("lo")] and p.decisions()["cut"] == 1
    p.leave(K("hi"), 1.5)
    p.tick(1.6)
    assert p.take_preemptions() == []


def test_a_gap_too_short_for_a_hand_over_is_not_cut() -> None:
    p = policy({"hi": HIGH, "lo": LOW}, guard_share=0.0001)
    phase(p, "lo", 0.0, compute=0.3, comm=0.1)
    phase(p, "hi", 1.0, compute=0.1, comm=0.2)
    assert p.request(K("lo"), 1, 1.275) == []  # 25 ms left, under a tenth of lo's 0.3 s phase
    assert p.decisions()["held_back"] == 1 and p.decisions()["cut"] == 0


def test_the_guard_serves_a_low_job_before_high_ones_at_its_guaranteed_share() -> None:
    p = policy({"h1": HIGH, "h2": HIGH, "lo": LOW}, guard_share=0.1, guard_window_s=10.0)
    phase(p, "lo", 0.0, compute=0.1, comm=0.1)  # credit now -0.1 s, earning 0.1 s per second
    t = 0.2
    for k in (K("h1"), K("h2"), K("lo")):
        p.request(k, 1, t)
    held = {"h1": 0.0, "h2": 0.0, "lo": 0.0}
    for i in range(300):  # every job asks again at once: a high rank always waits
        holder = next(k for k in (K("h1"), K("h2"), K("lo")) if p.holds(k))
        t += 0.1
        held[holder.job_id] += 0.1
        p.release(holder, t)
        p.request(holder, i + 2, t)
    share = held["lo"] / sum(held.values())
    assert p.decisions()["guard"] >= 25 and 0.08 <= share <= 0.12, (share, p.decisions())


def test_weights_within_a_class_share_the_device_by_weight() -> None:
    p = policy({"a": JobClass(Priority.NORMAL, 2.0), "b": NORMAL, "c": NORMAL})
    t = 0.0
    held = {"a": 0.0, "b": 0.0, "c": 0.0}
    for j in held:
        p.request(K(j), 0, t)
    for i in range(300):  # two jobs wait at every decision
        holder = next(k for k in (K("a"), K("b"), K("c")) if p.holds(k))
        t += 0.02
        held[holder.job_id] += 0.02
        p.release(holder, t)
        p.request(holder, i + 1, t)
    assert held["a"] / held["b"] == pytest.approx(2.0, rel=0.05) and held["b"] == pytest.approx(held["c"], rel=0.05)


def test_a_job_overdue_by_its_allreduce_leaves_its_gap_open() -> None:
    book = ClassBook()
    book.served("hi", 0.1, 1.0)
    book.observe_comm("hi", 0.2, 0.3)
    assert book.back_at("hi", 1.1) == pytest.approx(1.2)
    assert book.back_at("hi", 1.41) is None  # due at 1.2, overdue by more than 0.2 s


# ---- properties --------------------------------------------------------------------------------------

JOBS = ("a", "b", "c")


def _drive(p: CrossoverPolicy, seed: int, steps: int = 120) -> list[tuple[str, ...]]:
    """A random run of three one-rank jobs on one device; the grants of each step."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(steps):
        t += rng.uniform(0.001, 0.05)
        job = rng.choice(JOBS)
        k = K(job)
        if p.holds(k):
            p.observe(k, "compute", rng.uniform(0.01, 0.1), t)
            granted = p.release(k, t)
            p.observe(k, "comm", rng.uniform(0.01, 0.1), t)
        elif p.is_waiting(k):
            granted = p.tick(t)
        else:
            granted = p.request(k, i, t)
        out.append(tuple(g.job_id for g in granted))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cls=st.sampled_from([HIGH, NORMAL, LOW, JobClass(Priority.LOW, 3.0)]))
def test_equal_classes_decide_exactly_as_the_policy_without_classes(seed: int, cls: JobClass) -> None:
    plain = policy({})
    for j in JOBS:
        plain.join(ref(j), 0.0)
    classed = policy(dict.fromkeys(JOBS, cls))
    assert _drive(classed, seed) == _drive(plain, seed)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cls=st.sampled_from([HIGH, NORMAL, LOW, JobClass(Priority.LOW, 3.0)]))
def test_equal_classes_decide_exactly_as_before_with_the_isolation_controller_on(seed: int, cls: JobClass) -> None:
    """As shipped (`--protect 0.97`): the controller exists only where priorities differ."""
    plain = CrossoverPolicy()
    for j in JOBS:
        plain.join(ref(j), 0.0)
    classed = CrossoverPolicy()
    for j in JOBS:
        classed.join(ref(j), 0.0)
        classed.classify(j, cls, 0.0)
    assert _drive(classed, seed) == _drive(plain, seed)
    assert not classed.isolation


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_two_nodes_fed_the_same_events_decide_alike(seed: int) -> None:
    classes = {"a": HIGH, "b": LOW, "c": JobClass(Priority.LOW, 2.0)}
    assert _drive(policy(classes), seed) == _drive(policy(classes), seed)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_high_rank_is_never_passed_by_a_lower_grant(seed: int) -> None:
    """While a high rank waits, the device goes to a lower job only through the guard (bounded by its share)."""
    classes = {"a": HIGH, "b": LOW, "c": NORMAL}
    p = policy(classes, guard_share=0.0)
    rng = random.Random(seed)
    t = 0.0
    for i in range(150):
        t += rng.uniform(0.001, 0.05)
        k = K(rng.choice(JOBS))
        high_waiting = p.is_waiting(K("a"))
        if p.holds(k):
            granted = p.release(k, t)
        elif p.is_waiting(k):
            granted = p.tick(t)
        else:
            granted = p.request(k, i, t)
        if high_waiting:
            assert all(g.job_id == "a" for g in granted), (i, granted)


def test_the_queue_shows_higher_classes_first() -> None:
    p = policy({"hi": HIGH, "lo": LOW, "x": NORMAL})
    p.request(K("x"), 0, 0.0)
    p.request(K("lo"), 0, 0.1)
    p.request(K("hi"), 0, 0.2)
    assert p.order(0) == [K("hi"), K("lo")]



def test_the_queue_order_puts_a_higher_job_away_before_a_lower_one_held_back_as_the_policy_serves() -> None:
    p = policy({"prod": NORMAL, "sweep": LOW}, guard_share=0.0001, cut_turns=False)
    phase(p, "sweep", 0.0, compute=0.3, comm=0.1)
    phase(p, "prod", 1.0, compute=0.1, comm=0.2)
    assert p.request(K("prod"), 1, 1.3) == [K("prod")]  # prod holds; sweep asks and is held back
    assert p.request(K("sweep"), 1, 1.32) == []
    assert p.view(0).waiting == (K("sweep"),)
    assert p.view(0).order == ("prod", "sweep")  # not the waiting sweep first: it is not served next
    p.release(K("prod"), 1.4)
    served_next = p.request(K("prod"), 2, 1.45)  # back before its allreduce is out: the policy's own decision
    assert served_next == [K("prod")] and p.view(0).order[0] == "prod"


def test_a_phase_the_guard_serves_is_not_asked_to_yield() -> None:
    p = policy({"prod": NORMAL, "sweep": LOW}, guard_share=0.5)
    phase(p, "sweep", 0.0, compute=0.3, comm=0.1)
    phase(p, "prod", 1.0, compute=0.1, comm=0.2)  # its gaps: 0.2 s, which sweep's 0.3 s does not fit
    assert p.request(K("prod"), 1, 5.0) == [K("prod")]
    assert p.request(K("sweep"), 1, 5.01) == []
    assert p.release(K("prod"), 5.02) == [K("sweep")] and p.decisions()["guard"] == 1  # its credit is due
    assert p.request(K("prod"), 2, 5.03) == []  # prod waits out the guaranteed phase
    assert p.take_preemptions() == []


def test_the_queue_order_puts_a_lower_job_whose_guard_is_due_first() -> None:
    p = policy({"prod": NORMAL, "sweep": LOW}, guard_share=0.5)
    phase(p, "sweep", 0.0, compute=0.01, comm=0.1)
    assert p.request(K("prod"), 1, 5.0) == [K("prod")]
    assert p.request(K("sweep"), 1, 5.01) == []
    assert p.view(0).order == ("sweep", "prod")
    assert p.release(K("prod"), 5.02) == [K("sweep")]
