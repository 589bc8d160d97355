"""The emulated benchmark's scenarios: where each job runs, and which scenarios the issue's targets judge."""
from __future__ import annotations

import pytest

from bench.emulated.judge import targets
from bench.emulated.scenarios import ALL, CHURN, FULL, Scenario


def test_a_job_without_a_placement_runs_on_every_node() -> None:
    scn = Scenario("1:1 x2", 1.0, 2)
    assert scn.nodes == 2 and scn.nodes_of(0) is None and scn.nodes_of(1) is None


def test_churn_is_run_only_when_named() -> None:
    assert CHURN.visitor and CHURN in ALL and CHURN not in FULL


def test_span_puts_two_jobs_on_overlapping_node_pairs() -> None:
    span = next(s for s in FULL if s.name == "span x2")
    assert span.nodes == 3
    assert set(span.nodes_of(0) or ()) & set(span.nodes_of(1) or ()) == {1}


@pytest.mark.parametrize("placement", [((0, 1),), ((0, 1), (1, 3)), ((0, 1), (-1, 2))])
def test_a_placement_must_name_existing_nodes_for_every_job(placement: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(ValueError, match="placement"):
        Scenario("bad", 1.0, 2, nodes=3, placement=placement)


def test_scenario_names_are_unique() -> None:
    assert len({s.name for s in ALL}) == len(ALL)


def _summary(placement: list[list[int]]) -> dict:
    xo = {"vs_unscheduled": 1.4, "vs_sequential": 1.6, "of_bound": 0.9, "fairness": 1.1}
    return {"target_ratio": 1.0, "jobs": 2, "placement": placement, "visitor": False, "modes": {"crossover": xo}}


def test_the_targets_judge_two_jobs_on_the_same_nodes_only() -> None:
    assert targets(_summary([])) == {"crossover_vs_unscheduled_ge_1.35": True, "crossover_vs_sequential_ge_1.5": True,
                                     "crossover_of_bound_ge_0.85": True, "crossover_fairness_le_1.2": True}
    assert targets(_summary([[0, 1], [1, 2]])) is None


def test_the_device_models_set_adds_three_jobs_on_four_nodes() -> None:
    from bench.emulated.scenarios import MODEL

    wide = [s for s in MODEL if s.nodes == 4]
    assert len(wide) == 1 and wide[0].jobs == 3 and wide[0].nodes_of(2) is None
    assert set(FULL) <= set(MODEL)


def test_spread_is_the_farthest_cycle_from_the_median() -> None:
    from bench.emulated.judge import spread

    assert spread([1.0, 1.02, 0.97]) == pytest.approx(0.03)
    assert spread([1.1]) == 0.0
    assert spread([]) is None
