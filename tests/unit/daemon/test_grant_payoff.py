"""The per-device rule that keeps grants only where they pay (`crossover.daemon.grant_payoff`)."""
from __future__ import annotations

import pytest

from crossover.daemon.grant_payoff import Mode, PayoffJudge, PayoffSettings, Verdict

S = PayoffSettings(window_s=1.0, settle_share=0.2, probe_pairs=2, hold_windows=5, margin=0.01)


def drive(judge: PayoffJudge, rates: dict[Mode, dict[str, float]], start: float, end: float, step: float = 0.05,
          jobs: tuple[str, ...] = ("a", "b"), counts: dict[str, float] | None = None) -> list:
    """Feed the judge from `start` to `end`: each job progresses at the rate of the mode the judge chose."""
    counts = counts if counts is not None else {j: 0.0 for j in jobs}
    seen = []
    t = start
    while t < end:
        verdict = judge.sample(t, {j: int(counts[j]) for j in jobs})
        seen.append((round(t, 3), verdict))
        for j in jobs:
            counts[j] += rates[verdict.mode][j] * step
        t += step
    return seen


def modes_by_window(seen) -> dict[int, set[Mode]]:
    out: dict[int, set[Mode]] = {}
    for t, v in seen:
        out.setdefault(int(t // 1.0), set()).add(v.mode)
    return out


def test_it_keeps_grants_where_they_pay_and_drops_them_where_they_do_not():
    pay = {Mode.SCHEDULED: {"a": 110.0, "b": 55.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0}}
    j = PayoffJudge(S)
    seen = drive(j, pay, 10.0, 16.5)
    assert j.verdict.mode is Mode.SCHEDULED and not j.verdict.probing
    assert j.verdict.score == pytest.approx(1.1, abs=0.03) and "grants pay" in j.verdict.reason
    by_w = modes_by_window(seen)
    assert by_w[12] == {Mode.SCHEDULED} and by_w[13] == {Mode.UNSCHEDULED}  # the probe starts on an even window

    cost = {Mode.SCHEDULED: {"a": 80.0, "b": 40.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0}}
    j = PayoffJudge(S)
    drive(j, cost, 10.0, 16.5)
    assert j.verdict.mode is Mode.UNSCHEDULED and j.verdict.score == pytest.approx(0.8, abs=0.03)
    assert "do not pay" in j.verdict.reason


def test_a_tie_goes_to_sharing_without_us():
    tie = {m: {"a": 100.0, "b": 50.0} for m in Mode}
    j = PayoffJudge(S)
    drive(j, tie, 10.0, 16.5)
    assert j.verdict.mode is Mode.UNSCHEDULED


def test_every_job_counts_alike_whatever_its_rate():
    """One fast job 5 % faster scheduled, one slow job 30 % slower: the mean of ratios says no,
    though the summed rate (dominated by the fast job) would say yes."""
    mixed = {Mode.SCHEDULED: {"a": 1050.0, "b": 7.0}, Mode.UNSCHEDULED: {"a": 1000.0, "b": 10.0}}
    j = PayoffJudge(S)
    drive(j, mixed, 10.0, 16.5)
    assert j.verdict.mode is Mode.UNSCHEDULED


def drive_scored(judge: PayoffJudge, rates: dict[Mode, dict[str, float]], scored: frozenset[str], start: float,
                 end: float, counts: dict[str, float]) -> None:
    t = start
    while t < end:
        verdict = judge.sample(t, {j: int(v) for j, v in counts.items()}, scored)
        for j in counts:
            counts[j] += rates[verdict.mode][j] * 0.05
        t += 0.05


def test_where_classes_differ_grants_stay_only_if_they_pay_the_highest_class():
    """Grants that slow the production job `a` by 4 % are dropped though they double the low job's progress
    (as on a GPU at 1:1, where time-slicing left it faster); grants that speed `a` up stay though they
    starve the low job `b` (compute-bound)."""
    costs_a = {Mode.SCHEDULED: {"a": 85.0, "b": 90.0}, Mode.UNSCHEDULED: {"a": 89.0, "b": 45.0}}
    j = PayoffJudge(S)
    drive_scored(j, costs_a, frozenset({"a"}), 10.0, 16.5, {"a": 0.0, "b": 0.0})
    assert j.verdict.mode is Mode.UNSCHEDULED and j.verdict.score == pytest.approx(85 / 89, abs=0.02)
    assert "highest class" in j.verdict.reason
    assert PayoffJudge(S).verdict.mode is Mode.SCHEDULED
    pays_a = {Mode.SCHEDULED: {"a": 85.0, "b": 5.0}, Mode.UNSCHEDULED: {"a": 78.0, "b": 78.0}}
    j = PayoffJudge(S)
    drive_scored(j, pays_a, frozenset({"a"}), 10.0, 16.5, {"a": 0.0, "b": 0.0})
    assert j.verdict.mode is Mode.SCHEDULED and j.verdict.score == pytest.approx(85 / 78, abs=0.02)
    counts = {"a": 0.0, "b": 0.0}
    j = PayoffJudge(S)
    drive_scored(j, costs_a, frozenset({"a", "b"}), 10.0, 16.5, counts)
    assert j.verdict.mode is Mode.SCHEDULED and "the progress" in j.verdict.reason  # one class: both score
    drive_scored(j, costs_a, frozenset({"a"}), 16.5, 18.5, counts)
    assert j.verdict.probing  # a class change starts a new probe, from the next even window
    drive_scored(j, costs_a, frozenset({"a"}), 18.5, 22.5, counts)
    assert j.verdict.mode is Mode.UNSCHEDULED and "highest class" in j.verdict.reason


def test_a_verdict_held_from_outside_is_followed_by_a_fresh_probe():
    """Weights forced grants on for a while; once they are equal again the next sample probes at once,
    whatever verdict was held before them."""
    cost = {Mode.SCHEDULED: {"a": 80.0, "b": 40.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0}}
    j = PayoffJudge(S)
    counts = {"a": 0.0, "b": 0.0}
    drive(j, cost, 10.0, 16.5, counts=counts)
    assert j.verdict.mode is Mode.UNSCHEDULED and not j.verdict.probing  # held until window 21
    forced = j.hold(Verdict(Mode.SCHEDULED, "its jobs differ in weight"))
    assert forced.mode is Mode.SCHEDULED and j.verdict is forced
    seen = drive(j, cost, 17.0, 19.5, counts=counts)
    assert any(v.probing for _, v in seen), "the held verdict outlived the weights"


def test_the_verdict_holds_then_the_device_probes_again():
    cost = {Mode.SCHEDULED: {"a": 80.0, "b": 40.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0}}
    j = PayoffJudge(S)
    counts = {"a": 0.0, "b": 0.0}
    drive(j, cost, 10.0, 16.5, counts=counts)
    assert j.verdict.mode is Mode.UNSCHEDULED  # decided at window 16, held until window 21
    seen = drive(j, cost, 16.5, 21.0, counts=counts)
    assert {v.mode for _, v in seen} == {Mode.UNSCHEDULED}
    seen = drive(j, cost, 21.0, 23.0, counts=counts)
    assert any(v.probing for _, v in seen), "no new probe after the hold"


def test_a_job_arriving_starts_a_new_probe_and_one_job_alone_is_scheduled():
    cost = {Mode.SCHEDULED: {"a": 80.0, "b": 40.0, "c": 10.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0, "c": 10.0}}
    j = PayoffJudge(S)
    counts = {"a": 0.0, "b": 0.0, "c": 0.0}
    drive(j, cost, 10.0, 17.0, counts=counts)
    assert j.verdict.mode is Mode.UNSCHEDULED and not j.verdict.probing
    seen = drive(j, cost, 17.0, 19.5, jobs=("a", "b", "c"), counts=counts)
    assert any(v.probing for _, v in seen)
    alone = j.sample(20.0, {"a": 5})
    assert alone.mode is Mode.SCHEDULED and "one job" in alone.reason


def test_nodes_sampling_at_different_moments_agree_on_every_window():
    rates = {Mode.SCHEDULED: {"a": 80.0, "b": 40.0}, Mode.UNSCHEDULED: {"a": 100.0, "b": 50.0}}
    one, two = PayoffJudge(S), PayoffJudge(S)
    a = modes_by_window(drive(one, rates, 10.0, 24.0, step=0.05))
    b = modes_by_window(drive(two, rates, 10.013, 24.0, step=0.07))
    assert a == b


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="settle"):
        PayoffSettings(window_s=1.0, settle_share=1.0)
    with pytest.raises(ValueError, match="margin"):
        PayoffSettings(margin=1.5)
    with pytest.raises(ValueError, match="probe_pairs"):
        PayoffSettings(probe_pairs=0)
