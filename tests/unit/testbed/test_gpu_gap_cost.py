"""bench.gpu.gap_cost's pure part: how a run's step times become medians and the cost a neighbour adds."""
from bench.gpu.gap_cost import judge


def test_each_condition_adds_its_median_over_the_probe_alone() -> None:
    times = {"alone": {"h2d_each": [1.0, 2.0, 9.0], "kernel": [0.1, 0.1, 0.2]},
             "free": {"h2d_each": [20.0, 21.0, 50.0], "kernel": [1.0, 2.0, 3.0]}}
    result = judge(times)
    assert result["median_ms"] == {"alone": {"h2d_each": 2.0, "kernel": 0.1}, "free": {"h2d_each": 21.0, "kernel": 2.0}}
    assert result["added_ms"] == {"free": {"h2d_each": 19.0, "kernel": 1.9}}


def test_a_step_without_times_or_without_an_alone_figure_is_left_out() -> None:
    result = judge({"alone": {"d2h": [3.0]}, "paced": {"d2h": [5.0], "kernel": [1.0], "h2d_each": []}})
    assert result["median_ms"]["paced"] == {"d2h": 5.0, "kernel": 1.0}
    assert result["added_ms"] == {"paced": {"d2h": 2.0}}
