"""Semi-dynamic per-rank batch sizes (LB-BSP; Chen et al., SoCC 2020).

In a heterogeneous or shared cluster every synchronous iteration waits for the
slowest rank. LB-BSP keeps the global batch ``B`` fixed and, only at iteration
boundaries, gives faster ranks more samples and slower ranks fewer so that
all ranks finish their compute phase at about the same time. Gradients are
then combined with weights ``b_i / B`` (:func:`~.apportion.aggregation_weights`), which
makes the update the mean gradient over all ``B`` samples, as in plain BSP.

:class:`BatchSizeController` is pure: it is fed with measurements (identical
lists on every rank, e.g. after an allgather) and returns an assignment. All
arithmetic is plain Python floats in a fixed order and rounding is by largest
remainder with ties broken by rank, so every rank computes the same list from
the same inputs without further communication.

Two prediction methods:

* ``"ema"`` — compute time is taken as linear in the batch size (CPU
  clusters), ``t_i(b) = a_i + k_i·b``: a fixed per-iteration cost ``a_i``
  (batch fetch, launch and Python overheads, which a slower device stretches
  too) plus a per-sample cost ``k_i``, fitted by exponentially weighted least
  squares over each rank's measurements. While a rank's batch sizes have
  barely varied the intercept cannot be told from noise and the fit falls
  back to time proportional to ``b`` (``a_i = 0``). Sizes are those that
  equalise the predicted times (clamped to the caps). Why the intercept: with
  a proportional model a straggler's per-sample speed falls as its batch
  shrinks, so the allocation creeps towards the balance over many periods;
  with the affine fit it lands there at the next decision. Once size changes have
  shown the fixed cost's share ``a/k`` (:class:`SizeRun`, the times just
  before and after a change, so at one speed), every rank uses that shape with
  its own recent speed. Times enter the averages through a median of three
  (:meth:`SizeRun.steady_time`): a one-step hiccup is not a slower device.
* ``"numerical"`` — batch time is non-linear in the batch size (GPUs are
  under-used at small batches): each rank's time curve ``t_i(b)`` is fitted
  piecewise-linearly through its recent ``(b, t)`` points, and sizes that
  equalise predicted times are searched for: a fast approach (the
  proportional allocation above) followed by fine-tuning that moves samples
  from the slowest predicted rank to the fastest while that improves the
  predicted finishing times. See :meth:`BatchSizeController.propose`.

Changes take effect only every ``period`` iterations and only when some rank's
size would move by more than ``max(1, hysteresis × current)`` samples, so
measurement noise does not make sizes oscillate. Each rank's first ``warmup``
measurements are left out: a job's first steps are not its pace.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from typing import Optional

from crossover.plugins.aggregation.lbbsp.adoption import adopt
from crossover.plugins.aggregation.lbbsp.apportion import apportion, equal_time_shares, round_shares
from crossover.plugins.aggregation.lbbsp.config import (
    BatchSizeConfig,
    BatchSizeConfigError,
    Measurement,
    MeasurementError,
    is_int,
)
from crossover.plugins.aggregation.lbbsp.estimators import AffineFit, Scatter, SizeRun, TimeCurve

__all__ = ["BatchSizeController"]

logger = logging.getLogger(__name__)

_MAX_FINE_TUNE_STEPS = 10_000


class BatchSizeController:
    """Decides every rank's batch size from measured compute times (LB-BSP).

    Every rank owns one controller built from the same config and calls
    :meth:`update` once per iteration with the same measurement list; all
    controllers then return the same assignment. Not thread-safe (one caller,
    the training loop, at step boundaries).
    """

    def __init__(self, config: BatchSizeConfig, initial_sizes: Optional[Sequence[int]] = None) -> None:
        self._config = config
        self._mins = config.min_sizes()
        self._maxs = config.max_sizes()
        if initial_sizes is None:
            sizes = apportion(config.global_batch, [1.0] * config.world_size, self._mins, self._maxs)
        else:
            sizes = list(initial_sizes)
            self._check_assignment(sizes)
        self._sizes = tuple(sizes)
        self._speeds: list[Optional[float]] = [None] * config.world_size
        self._curves = [TimeCurve(config.ema_alpha, config.history) for _ in range(config.world_size)]
        self._fits = [AffineFit(config.ema_alpha) for _ in range(config.world_size)]
        self._runs = [SizeRun() for _ in range(config.world_size)]
        span = max(Scatter.MIN_POINTS, min(Scatter.MAX_POINTS, round((2.0 - config.ema_alpha) / config.ema_alpha)))
        self._scatters = [Scatter(span) for _ in range(config.world_size)]
        self._skipped = [0] * config.world_size  # measurements left out so far (warmup)
        self._last_iteration: Optional[int] = None

    def _check_assignment(self, sizes: Sequence[int]) -> None:
        cfg = self._config
        if len(sizes) != cfg.world_size or sum(sizes) != cfg.global_batch or any(
            not is_int(size) or not lo <= size <= hi
            for size, lo, hi in zip(sizes, self._mins, self._maxs)
        ):
            raise BatchSizeConfigError(
                f"initial_sizes {list(sizes)} must have {cfg.world_size} ints within the caps "
                f"summing to global_batch={cfg.global_batch}"
            )

    @property
    def config(self) -> BatchSizeConfig:
        """The settings this controller was built with."""
        return self._config

    @property
    def sizes(self) -> tuple[int, ...]:
        """The current assignment, one batch size per rank, summing to ``B``."""
        return self._sizes

    @property
    def speeds(self) -> tuple[Optional[float], ...]:
        """EMA of samples/second per rank (``None`` until a rank has reported)."""
        return tuple(self._speeds)

    def observe(self, measurements: Sequence[Measurement]) -> None:
        """Fold measurements into the per-rank estimates (no decision); each rank's
        first ``warmup`` valid measurements are checked and left out."""
        for item in measurements:
            if not is_int(item.rank) or not 0 <= item.rank < self._config.world_size:
                raise MeasurementError(
                    f"measurement rank {item.rank!r} outside [0, {self._config.world_size})"
                )
            if not is_int(item.batch_size) or item.batch_size < 1:
                raise MeasurementError(
                    f"rank {item.rank}: batch_size must be an int >= 1, got {item.batch_size!r}"
                )
            seconds = item.compute_seconds
            if not isinstance(seconds, (int, float)) or not (math.isfinite(seconds) and seconds > 0):
                raise MeasurementError(
                    f"rank {item.rank}: compute_seconds must be finite and > 0, got {seconds!r}"
                )
            if self._skipped[item.rank] < self._config.warmup:
                self._skipped[item.rank] += 1
                continue
            run = self._runs[item.rank]
            run.add(item.batch_size, float(seconds))
            self._scatters[item.rank].add(item.batch_size, float(seconds))
            seconds = run.steady_time()
            speed = item.batch_size / seconds
            previous = self._speeds[item.rank]
            alpha = self._config.ema_alpha
            self._speeds[item.rank] = speed if previous is None else alpha * speed + (1 - alpha) * previous
            self._curves[item.rank].add(item.batch_size, float(seconds))
            self._fits[item.rank].add(item.batch_size, float(seconds))

    def update(self, iteration: int, measurements: Sequence[Measurement]) -> list[int]:
        """Record iteration ``iteration``'s measurements; return the sizes for the next one.

        ``iteration`` is the 0-based index of the iteration just finished. At a
        period boundary (``(iteration + 1) % period == 0``) a new assignment is
        proposed and adopted if it passes the hysteresis test (:func:`~.adoption.adopt`
        without a ``min_gain``); otherwise the
        current sizes are returned unchanged.
        """
        if not is_int(iteration) or iteration < 0:
            raise MeasurementError(f"iteration must be an int >= 0, got {iteration!r}")
        if self._last_iteration is not None and iteration <= self._last_iteration:
            logger.warning(
                "batch-size controller got iteration %d after %d; decisions may diverge across ranks",
                iteration, self._last_iteration,
            )
        self._last_iteration = iteration
        self.observe(measurements)
        if (iteration + 1) % self._config.period != 0:
            return list(self._sizes)
        proposal = self.propose()
        if proposal is None:
            logger.debug("iteration %d: not every rank has reported yet; sizes kept", iteration)
            return list(self._sizes)
        adopted = adopt(self, proposal, self._sizes, min_gain=None)
        if adopted is not None:
            logger.info("iteration %d: batch sizes %s -> %s", iteration, list(self._sizes), adopted)
            self._sizes = tuple(adopted)
        return list(self._sizes)

    def predicted_times(self, sizes: Sequence[int]) -> Optional[list[float]]:
        """Predicted compute seconds of each rank for ``sizes`` under the configured
        method, or ``None`` while some rank has no measurement."""
        if self._config.method == "ema":
            if not all(self._fits):
                return None
            return [a + k * size for (a, k), size in zip(self._models(), sizes)]
        if not all(self._curves):
            return None
        return [curve.predict(size) for curve, size in zip(self._curves, sizes)]

    def _models(self) -> list[tuple[float, float]]:
        """Each rank's ``(a, k)`` for the ``ema`` method.

        Once any rank's size changes have shown the fixed cost's shape, every rank
        uses the median of those shapes (the same code on every rank: a slower device
        stretches its fixed and per-sample costs alike) with its own recent speed;
        before that, each rank's own regression.
        """
        shapes = [shape for run in self._runs for shape in run.shapes]
        # A fixed cost worth more than the whole global batch is noise, not a measurement.
        pooled = min(statistics.median(shapes), float(self._config.global_batch)) if shapes else None
        return [fit.coefficients(pooled) for fit in self._fits]

    def prediction_errors(self) -> Optional[list[float]]:
        """Per rank, how far (seconds) its predicted time at its latest batch
        size may be off, from its recent measurements around its fitted line
        (for ``ema``, the line its predictions use): their bias and their
        standard error. ``None`` while some rank has no measurement."""
        if not all(self._fits):
            return None
        if self._config.method == "ema":
            models = self._models()
        else:
            models = [fit.coefficients() for fit in self._fits]
        return [scatter.error(a, k) for scatter, (a, k) in zip(self._scatters, models)]

    def propose(self) -> Optional[list[int]]:
        """The assignment the method would choose now (ignoring period and
        hysteresis), or ``None`` while some rank has no measurement.

        ``ema``: the sizes that equalise the fitted ``a_i + k_i·b_i``, clamped
        to the caps (proportional to the speeds while no intercept is known).
        ``numerical``: start from the better (under the fitted curves) of that
        proportional allocation, using each rank's latest ``b/t`` as its speed,
        and the current sizes; then repeatedly move ``step`` samples from the
        rank with the largest predicted time to the rank whose predicted time
        after receiving them is smallest, keeping the move only if the
        predicted times sorted in descending order decrease lexicographically
        (the makespan first, then the next-slowest, ...), and halving ``step``
        when it does not, until ``step < 1``. ``step`` starts at
        ``B / (2 × world_size)``. Each kept move strictly improves that
        objective, so the search terminates.
        """
        cfg = self._config
        if cfg.method == "ema":
            if not all(self._fits):
                return None
            models = self._models()
            shares = equal_time_shares(cfg.global_batch, models, self._mins, self._maxs)
            return round_shares(cfg.global_batch, shares, self._mins, self._maxs)
        if not all(self._curves):
            return None
        latest_speeds = [batch / seconds for batch, seconds in (c.latest() for c in self._curves)]
        start = apportion(cfg.global_batch, latest_speeds, self._mins, self._maxs)
        return self._fine_tune(start)

    def _objective(self, sizes: Sequence[int]) -> tuple[float, ...]:
        return tuple(sorted((c.predict(s) for c, s in zip(self._curves, sizes)), reverse=True))

    def _fine_tune(self, start: list[int]) -> list[int]:
        current = list(self._sizes)
        sizes = start if self._objective(start) <= self._objective(current) else current
        best = self._objective(sizes)
        count = len(sizes)
        step = max(1, self._config.global_batch // (2 * count))
        for _ in range(_MAX_FINE_TUNE_STEPS):
            if step < 1:
                break
            times = [c.predict(s) for c, s in zip(self._curves, sizes)]
            slowest = max(range(count), key=lambda r: (times[r], -r))
            give = min(step, sizes[slowest] - self._mins[slowest])
            receivers = [r for r in range(count) if r != slowest and sizes[r] < self._maxs[r]]
            if give < 1 or not receivers:
                break  # the makespan rank cannot shed samples: nothing can improve
            amounts = {r: min(give, self._maxs[r] - sizes[r]) for r in receivers}
            fastest = min(receivers, key=lambda r: (self._curves[r].predict(sizes[r] + amounts[r]), r))
            candidate = list(sizes)
            candidate[slowest] -= amounts[fastest]
            candidate[fastest] += amounts[fastest]
            score = self._objective(candidate)
            if score < best:
                sizes, best = candidate, score
            else:
                step //= 2
        else:
            logger.debug("fine-tuning stopped after %d steps", _MAX_FINE_TUNE_STEPS)
        return sizes
