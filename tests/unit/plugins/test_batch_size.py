"""LB-BSP batch-size controller: config validation, apportioning, the ema and
numerical methods, period, hysteresis and cross-rank determinism."""
from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.plugins.aggregation.lbbsp.apportion import aggregation_weights, apportion
from crossover.plugins.aggregation.lbbsp.config import (
    BatchSizeConfig,
    BatchSizeConfigError,
    BatchSizeError,
    Measurement,
    MeasurementError,
)
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController

Curve = Callable[[int], float]


def linear(seconds_per_sample: float) -> Curve:
    return lambda batch: seconds_per_sample * batch


def measure(
    sizes: Sequence[int], curves: Sequence[Curve], noise: float = 0.0, rng: random.Random | None = None
) -> list[Measurement]:
    out = []
    for rank, (size, curve) in enumerate(zip(sizes, curves)):
        factor = 1.0 + (rng.uniform(-noise, noise) if rng else 0.0)
        out.append(Measurement(rank, size, curve(size) * factor))
    return out


def simulate(
    config: BatchSizeConfig, curves: Sequence[Curve], iterations: int, noise: float = 0.0, seed: int = 0
) -> tuple[BatchSizeController, list[tuple[int, ...]]]:
    """Run the controller against synthetic ranks; return it and the sizes used per iteration."""
    rng = random.Random(seed)
    controller = BatchSizeController(config)
    history = []
    for iteration in range(iterations):
        history.append(controller.sizes)
        controller.update(iteration, measure(controller.sizes, curves, noise, rng))
    return controller, history


def makespan(sizes: Sequence[int], curves: Sequence[Curve]) -> float:
    return max(curve(size) for curve, size in zip(curves, sizes))


# --- config -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"global_batch": 0}, "global_batch"),
        ({"world_size": 0}, "world_size"),
        ({"period": 0}, "period"),
        ({"ema_alpha": 1.5}, "1.5"),
        ({"ema_alpha": 0.0}, "ema_alpha"),
        ({"hysteresis": -0.1}, "-0.1"),
        ({"method": "magic"}, "magic"),
        ({"history": 1}, "history"),
        ({"warmup": -1}, "warmup"),
        ({"min_batch": (1, 2)}, "min_batch"),
        ({"min_batch": 0}, "min_batch"),
        ({"max_batch": (8, 8, 2, 8), "min_batch": 3}, "max_batch"),
        ({"min_batch": 9}, "32"),
        ({"max_batch": 7}, "exceeds"),
        ({"global_batch": 32.0}, "32.0"),
    ],
)
def test_bad_config_raises_typed_error(kwargs: dict, named: str) -> None:
    settings_ = {"global_batch": 32, "world_size": 4, **kwargs}
    with pytest.raises(BatchSizeConfigError, match=named) as info:
        BatchSizeConfig(**settings_)
    assert isinstance(info.value, ValueError)


def test_config_normalises_per_rank_caps() -> None:
    config = BatchSizeConfig(global_batch=10, world_size=2, min_batch=[1, 2], max_batch=[8, 9])  # type: ignore[arg-type]
    assert config.min_sizes() == (1, 2) and config.max_sizes() == (8, 9)
    assert BatchSizeConfig(10, 2).max_sizes() == (10, 10)
    hash(config)  # frozen and hashable


# --- apportion and weights --------------------------------------------------------

def test_apportion_largest_remainder_ties_by_rank() -> None:
    assert apportion(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert apportion(11, [1.0, 1.0, 1.0]) == [4, 4, 3]
    assert apportion(100, [3.0, 3.0, 3.0, 1.0]) == [30, 30, 30, 10]


def test_apportion_respects_caps() -> None:
    # rank 0 would get 90 but is capped at 50; the rest is shared 1:1
    assert apportion(100, [9.0, 0.5, 0.5], mins=[1, 1, 1], maxs=[50, 100, 100]) == [50, 25, 25]
    # a very slow rank still gets its minimum
    assert apportion(100, [1.0, 1e-6], mins=[1, 5], maxs=[100, 100]) == [95, 5]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_apportion_sums_and_caps_property(data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 8))
    mins = data.draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))
    maxs = [low + data.draw(st.integers(0, 50)) for low in mins]
    total = data.draw(st.integers(sum(mins), sum(maxs)))
    weights = data.draw(st.lists(st.floats(1e-3, 1e3), min_size=count, max_size=count))
    sizes = apportion(total, weights, mins, maxs)
    assert sum(sizes) == total
    assert all(low <= size <= high for size, low, high in zip(sizes, mins, maxs))
    assert sizes == apportion(total, list(weights), list(mins), list(maxs))


def test_apportion_rejects_impossible_input() -> None:
    with pytest.raises(BatchSizeError):
        apportion(10, [1.0, 0.0])
    with pytest.raises(BatchSizeError):
        apportion(10, [1.0, 1.0], maxs=[4, 4])


def test_aggregation_weights() -> None:
    assert aggregation_weights([1, 3]) == [0.25, 0.75]
    assert sum(aggregation_weights([7, 5, 20])) == pytest.approx(1.0)
    with pytest.raises(BatchSizeError):
        aggregation_weights([0, 0])
    with pytest.raises(BatchSizeError):
        aggregation_weights([2, -1])


# --- controller -------------------------------------------------------------------

def test_initial_assignment_is_an_even_split() -> None:
    assert BatchSizeController(BatchSizeConfig(10, 3)).sizes == (4, 3, 3)
    assert BatchSizeController(BatchSizeConfig(10, 2), initial_sizes=[7, 3]).sizes == (7, 3)
    with pytest.raises(BatchSizeConfigError):
        BatchSizeController(BatchSizeConfig(10, 2), initial_sizes=[7, 4])


def test_three_times_slower_rank_gets_a_third_of_a_fast_share() -> None:
    curves = [linear(0.001), linear(0.001), linear(0.003), linear(0.001)]
    config = BatchSizeConfig(global_batch=100, world_size=4, period=1)
    controller, _ = simulate(config, curves, iterations=3)
    assert controller.sizes == (30, 30, 10, 30)
    fast, slow = controller.sizes[0], controller.sizes[2]
    assert slow / fast == pytest.approx(1 / 3, rel=0.05)
    times = [curve(size) for curve, size in zip(curves, controller.sizes)]
    assert max(times) / min(times) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("method", ["ema", "numerical"])
def test_sums_to_global_batch_and_respects_caps(method: str) -> None:
    curves = [linear(0.001), linear(0.010), linear(0.0005), linear(0.002)]
    config = BatchSizeConfig(
        global_batch=200, world_size=4, min_batch=(10, 20, 1, 1), max_batch=(100, 100, 70, 100),
        period=2, method=method,  # type: ignore[arg-type]
    )
    _, history = simulate(config, curves, iterations=30, noise=0.2)
    for sizes in history:
        assert sum(sizes) == 200
        assert all(lo <= s <= hi for s, lo, hi in zip(sizes, config.min_sizes(), config.max_sizes()))
    assert history[-1][1] == 20 and history[-1][2] == 70  # slow rank at its floor, fast at its cap


def test_sizes_change_only_at_period_boundaries() -> None:
    curves = [linear(0.001), linear(0.002)]
    config = BatchSizeConfig(global_batch=60, world_size=2, period=4, ema_alpha=0.5)
    _, history = simulate(config, curves, iterations=20, noise=0.3, seed=3)
    # history[i] are the sizes used in iteration i; a change may appear only in
    # an iteration right after a boundary (i % period == 0)
    changed = [i for i in range(1, len(history)) if history[i] != history[i - 1]]
    assert changed, "the slower rank should lose samples"
    assert all(i % 4 == 0 for i in changed)
    assert history[:4] == [(30, 30)] * 4


def test_hysteresis_stops_oscillation_under_noise() -> None:
    curves = [linear(0.01), linear(0.01)]
    noisy = BatchSizeConfig(global_batch=100, world_size=2, period=5, hysteresis=0.0)
    _, history = simulate(noisy, curves, iterations=200, noise=0.1, seed=7)
    flips = sum(1 for a, b in zip(history, history[1:]) if a != b)
    assert flips >= 5  # without hysteresis the noise alone moves the sizes around
    damped = BatchSizeConfig(global_batch=100, world_size=2, period=5, hysteresis=0.1)
    _, history = simulate(damped, curves, iterations=200, noise=0.1, seed=7)
    assert set(history) == {(50, 50)}


def test_hysteresis_still_lets_real_changes_through() -> None:
    curves = [linear(0.01), linear(0.02)]
    config = BatchSizeConfig(global_batch=90, world_size=2, period=5, hysteresis=0.1)
    controller, _ = simulate(config, curves, iterations=20, noise=0.05, seed=1)
    assert controller.sizes[0] == pytest.approx(60, abs=3)


@pytest.mark.parametrize("method", ["ema", "numerical"])
def test_controllers_on_all_ranks_agree(method: str) -> None:
    rng = random.Random(11)
    config = BatchSizeConfig(global_batch=256, world_size=5, period=3, hysteresis=0.02, method=method)  # type: ignore[arg-type]
    ranks = [BatchSizeController(config) for _ in range(5)]
    for iteration in range(60):
        sizes = ranks[0].sizes
        batch = [
            Measurement(r, sizes[r], (0.01 + 1e-4 * (r + 1) * sizes[r] ** 1.5) * rng.uniform(0.8, 1.2))
            for r in range(5)
        ]
        results = {tuple(c.update(iteration, batch)) for c in ranks}
        assert len(results) == 1


def test_start_up_steps_are_left_out_of_the_estimates() -> None:
    # A job's first steps: rank 1 is still starting (three steps at 4x). Its real pace is
    # the others'. With no warmup the first decision takes most of its batch away.
    def first_decision(warmup: int) -> list[int]:
        controller = BatchSizeController(BatchSizeConfig(global_batch=256, world_size=4, period=6, warmup=warmup))
        sizes: list[int] = []
        for step in range(6):
            slow = 4.0 if step < 3 else 1.0
            sizes = controller.update(step, [Measurement(r, 64, 0.064 * (slow if r == 1 else 1.0))
                                             for r in range(4)])
        return sizes

    assert first_decision(warmup=3) == [64, 64, 64, 64]
    assert first_decision(warmup=0)[1] < 48  # a quarter of its batch gone


def test_no_decision_until_every_rank_reported() -> None:
    controller = BatchSizeController(BatchSizeConfig(global_batch=20, world_size=2, period=1))
    assert controller.update(0, [Measurement(0, 10, 0.1)]) == [10, 10]
    assert controller.propose() is None and controller.predicted_times([10, 10]) is None
    assert controller.update(1, [Measurement(1, 10, 0.3)]) == [15, 5]


@pytest.mark.parametrize(
    "measurement",
    [Measurement(2, 10, 0.1), Measurement(0, 0, 0.1), Measurement(0, 10, 0.0), Measurement(0, 10, float("nan"))],
)
def test_bad_measurements_raise(measurement: Measurement) -> None:
    controller = BatchSizeController(BatchSizeConfig(global_batch=20, world_size=2))
    with pytest.raises(MeasurementError):
        controller.update(0, [measurement])
    with pytest.raises(MeasurementError):
        controller.update(-1, [])


def _optimum(total: int, curves: Sequence[Curve]) -> float:
    best = float("inf")
    for head in itertools.product(range(1, total), repeat=len(curves) - 1):
        last = total - sum(head)
        if last >= 1:
            best = min(best, makespan((*head, last), curves))
    return best


def test_numerical_method_converges_on_quadratic_curves() -> None:
    curves = [lambda b: 0.01 + 1e-5 * b * b, lambda b: 0.01 + 4e-5 * b * b, lambda b: 0.02 + 2e-5 * b * b]
    config = BatchSizeConfig(
        global_batch=192, world_size=3, period=2, hysteresis=0.0, ema_alpha=1.0, method="numerical"
    )
    controller, history = simulate(config, curves, iterations=20)
    spans = [makespan(sizes, curves) for sizes in history[::2]]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(spans, spans[1:]))  # no oscillation
    assert makespan(controller.sizes, curves) <= 1.05 * _optimum(192, curves)
    assert spans[0] / spans[-1] > 1.5


def test_numerical_method_with_fixed_overhead() -> None:
    # one rank has a large fixed cost (an under-used GPU), the other is steeply convex
    curves = [lambda b: 0.1 + 1e-6 * b * b, lambda b: 1e-4 * b * b]
    config = BatchSizeConfig(
        global_batch=256, world_size=2, period=1, hysteresis=0.0, ema_alpha=1.0, method="numerical"
    )
    controller, history = simulate(config, curves, iterations=12)
    spans = [makespan(sizes, curves) for sizes in history]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(spans, spans[1:]))
    assert makespan(controller.sizes, curves) <= 1.02 * _optimum(256, curves)
    times = controller.predicted_times(controller.sizes)
    assert times is not None and len(times) == 2


def affine(fixed_s: float, seconds_per_sample: float, factor: float = 1.0) -> Curve:
    """A rank whose compute has a fixed part; a straggler stretches both parts by ``factor``."""
    return lambda batch: factor * (fixed_s + seconds_per_sample * batch)


def test_ema_lands_on_the_balance_one_decision_after_the_sizes_first_vary() -> None:
    # Fixed cost 12 ms + 0.29 ms/sample, rank 3 three times slower: the balance gives it
    # ~1.5 samples. A proportional model sees its per-sample speed fall as its batch shrinks
    # and creeps there over many periods; the affine fit gets there at the next decision.
    curves = [affine(0.012, 0.00029)] * 3 + [affine(0.012, 0.00029, factor=3.0)]
    config = BatchSizeConfig(global_batch=256, world_size=4, period=5, hysteresis=0.05, ema_alpha=0.3)
    controller, history = simulate(config, curves, iterations=11)
    first = history[5]  # proportional to the speeds at 64: nothing is known of the fixed cost yet
    assert first[3] == pytest.approx(256 / 10, abs=1)
    second = history[10]
    assert second[3] <= 2, f"the straggler should be near its balance after the second decision, got {second}"
    times = [curve(size) for curve, size in zip(curves, second)]
    assert max(times) / min(times) < 1.05


def test_ema_predicts_the_fixed_cost_it_has_seen() -> None:
    config = BatchSizeConfig(global_batch=100, world_size=2, period=1, ema_alpha=0.5)
    controller = BatchSizeController(config)
    curve = affine(0.010, 0.001)
    for size in (50, 20, 50, 20):
        controller.observe([Measurement(0, size, curve(size)), Measurement(1, 50, 0.06)])
    predicted = controller.predicted_times([5, 25])
    assert predicted is not None
    assert predicted[0] == pytest.approx(curve(5), rel=1e-9)  # rank 0: its own line, intercept included
    assert predicted[1] == pytest.approx(0.03, rel=1e-9)  # rank 1 never varied: proportional, 0.06 s at 50


def test_ema_reads_the_fixed_cost_off_a_size_change_even_when_the_speed_changes_later() -> None:
    # Rank 0 goes 64 -> 16 samples (the fixed cost shows: 3 steps either side), then its
    # device gets 2x slower and it stays at 16. A regression over its history would mix the
    # speeds with the sizes; the step keeps the shape (a/k = 40 samples) and the speed is
    # its own recent one: 2 x (0.02 + 0.0005 x 64) predicted at 64.
    config = BatchSizeConfig(global_batch=80, world_size=2, period=1, ema_alpha=0.3)
    controller = BatchSizeController(config)
    fast = affine(0.020, 0.0005)
    for size, factor in [(64, 1.0)] * 3 + [(16, 1.0)] * 3 + [(16, 2.0)] * 40:
        controller.observe([Measurement(0, size, fast(size) * factor), Measurement(1, 16, fast(16))])
    predicted = controller.predicted_times([64, 16])
    assert predicted is not None
    assert predicted[0] == pytest.approx(2 * fast(64), rel=1e-3)
    assert predicted[1] == pytest.approx(fast(16), rel=1e-3)  # rank 1 never changed size: the shared shape


def test_ema_falls_back_to_proportional_when_noise_fakes_a_negative_slope() -> None:
    config = BatchSizeConfig(global_batch=100, world_size=2, period=1, ema_alpha=0.5)
    controller = BatchSizeController(config)
    for size, seconds in ((40, 0.050), (60, 0.045)):  # more samples took less time: noise, not a model
        controller.observe([Measurement(0, size, seconds), Measurement(1, 50, 0.05)])
    predicted = controller.predicted_times([100, 50])
    assert predicted is not None and predicted[0] > 0.05  # still grows with the batch


@pytest.mark.parametrize("method", ["ema", "numerical"])
def test_first_measurement_does_not_stand_for_the_average(method: str) -> None:
    # A slow first measurement (a cold cache, a page fault) and three normal ones: with a
    # bias-corrected average the estimate sits near the normal ones after a few steps; an
    # average seeded with the first value would still be 70% of the way up after three.
    config = BatchSizeConfig(global_batch=100, world_size=2, period=1, ema_alpha=0.1,
                             method=method)  # type: ignore[arg-type]
    controller = BatchSizeController(config)
    for seconds in (0.10, 0.05, 0.05, 0.05):
        controller.observe([Measurement(0, 50, seconds), Measurement(1, 50, 0.05)])
    predicted = controller.predicted_times([50, 50])
    assert predicted is not None
    weights = [0.9 ** 3, 0.9 ** 2, 0.9, 1.0]
    expected = sum(w * t for w, t in zip(weights, (0.10, 0.05, 0.05, 0.05))) / sum(weights)
    assert predicted[0] == pytest.approx(expected, rel=1e-9)
    assert predicted[0] < 0.07


def test_one_hiccup_does_not_take_samples_from_an_equal_rank() -> None:
    # Four equal ranks; rank 2 is preempted once (one step at 5x) just before the first
    # decision. A moving average of four steps reads that as a slower device and moves a
    # fifth of its samples away; the median of its last three steps does not see it.
    controller = BatchSizeController(BatchSizeConfig(global_batch=256, world_size=4, period=5, ema_alpha=0.3))
    sizes: list[int] = []
    for step in range(5):
        sizes = controller.update(step, [Measurement(r, 64, 0.030 * (5.0 if (r, step) == (2, 3) else 1.0))
                                         for r in range(4)])
    assert sizes == [64, 64, 64, 64]
