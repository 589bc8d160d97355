"""Semi-dynamic per-rank batch sizes (LB-BSP; Chen et al., SoCC 2020).

In a heterogeneous or shared cluster every synchronous iteration waits for the
slowest rank. LB-BSP keeps the global batch ``B`` fixed and, only at iteration
boundaries, gives faster ranks more samples and slower ranks fewer so that
all ranks finish their compute phase at about the same time. Gradients are
then combined with weights ``b_i / B`` (:func:`aggregation_weights`), which
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
  shown the fixed cost's share ``a/k`` (:class:`_SizeRun`, the times just
  before and after a change, so at one speed), every rank uses that shape with
  its own recent speed. Times enter the averages through a median of three
  (:meth:`_SizeRun.steady_time`): a one-step hiccup is not a slower device.
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
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

__all__ = [
    "BatchSizeConfig",
    "BatchSizeConfigError",
    "BatchSizeController",
    "BatchSizeError",
    "Measurement",
    "MeasurementError",
    "Method",
    "aggregation_weights",
    "apportion",
]

logger = logging.getLogger(__name__)

Method = Literal["ema", "numerical"]
_METHODS = ("ema", "numerical")
_MAX_FINE_TUNE_STEPS = 10_000


class BatchSizeError(ValueError):
    """Base class of the errors raised by this module."""


class BatchSizeConfigError(BatchSizeError):
    """A :class:`BatchSizeConfig` field (or initial assignment) is invalid."""


class MeasurementError(BatchSizeError):
    """A :class:`Measurement` does not describe a real compute phase."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_rank(
    name: str, value: Union[int, Sequence[int]], world_size: int
) -> tuple[int, ...]:
    if _is_int(value):
        values: tuple[int, ...] = (int(value),) * world_size  # type: ignore[arg-type]
    else:
        values = tuple(value)  # type: ignore[arg-type]
        if len(values) != world_size:
            raise BatchSizeConfigError(
                f"{name} has {len(values)} entries, expected world_size={world_size}"
            )
    for rank, item in enumerate(values):
        if not _is_int(item):
            raise BatchSizeConfigError(f"{name}[{rank}] must be an int, got {item!r}")
    return values


@dataclass(frozen=True)
class BatchSizeConfig:
    """Settings of :class:`BatchSizeController`; validated on construction.

    Attributes:
        global_batch: ``B``, the number of samples per iteration over all ranks.
        world_size: number of ranks.
        min_batch: smallest per-rank batch, one int for all ranks or one per
            rank (at least 1: every rank must produce a gradient).
        max_batch: largest per-rank batch (e.g. what fits in that device's
            memory), one int or one per rank; ``None`` means ``B``.
        period: ``k``; sizes may change only after iterations ``k-1, 2k-1, ...``.
        hysteresis: ``h``; a new assignment is adopted only if some rank's size
            changes by more than ``max(1, h × its current size)`` samples.
        ema_alpha: weight of the newest measurement in the moving averages,
            in ``(0, 1]``.
        method: ``"ema"`` or ``"numerical"`` (see the module docstring).
        history: how many distinct recent batch sizes per rank the numerical
            method keeps as points of its time curve (>= 2).
        warmup: how many of each rank's first measurements are left out of
            its estimates: a job's first steps (allocator and caches warming,
            data-loader workers and other jobs still starting) are not its pace,
            and the first decision would otherwise rest on them alone.
    """

    global_batch: int
    world_size: int
    min_batch: Union[int, tuple[int, ...]] = 1
    max_batch: Optional[Union[int, tuple[int, ...]]] = None
    period: int = 10
    hysteresis: float = 0.05
    ema_alpha: float = 0.3
    method: Method = "ema"
    history: int = 8
    warmup: int = 0

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> BatchSizeConfig:
        """The config ``dataclasses.asdict`` (or a JSON round trip of it) gave; lists become tuples."""
        values: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                                  for key, value in fields.items()}
        return cls(**values)

    def __post_init__(self) -> None:
        for name in ("global_batch", "world_size", "period", "history", "warmup"):
            value = getattr(self, name)
            if not _is_int(value):
                raise BatchSizeConfigError(f"{name} must be an int, got {value!r}")
        if self.world_size < 1:
            raise BatchSizeConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.global_batch < 1:
            raise BatchSizeConfigError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.period < 1:
            raise BatchSizeConfigError(f"period must be >= 1, got {self.period}")
        if self.history < 2:
            raise BatchSizeConfigError(f"history must be >= 2, got {self.history}")
        if self.warmup < 0:
            raise BatchSizeConfigError(f"warmup must be >= 0, got {self.warmup}")
        if not isinstance(self.hysteresis, (int, float)) or not (
            math.isfinite(self.hysteresis) and self.hysteresis >= 0
        ):
            raise BatchSizeConfigError(f"hysteresis must be a finite number >= 0, got {self.hysteresis!r}")
        if not isinstance(self.ema_alpha, (int, float)) or not 0 < self.ema_alpha <= 1:
            raise BatchSizeConfigError(f"ema_alpha must be in (0, 1], got {self.ema_alpha!r}")
        if self.method not in _METHODS:
            raise BatchSizeConfigError(f"method must be one of {_METHODS}, got {self.method!r}")
        if not isinstance(self.min_batch, int):  # normalise lists to hashable tuples
            object.__setattr__(self, "min_batch", tuple(self.min_batch))
        if self.max_batch is not None and not isinstance(self.max_batch, int):
            object.__setattr__(self, "max_batch", tuple(self.max_batch))
        mins, maxs = self.min_sizes(), self.max_sizes()
        for rank, (low, high) in enumerate(zip(mins, maxs)):
            if low < 1:
                raise BatchSizeConfigError(f"min_batch for rank {rank} must be >= 1, got {low}")
            if high < low:
                raise BatchSizeConfigError(
                    f"max_batch for rank {rank} is {high}, below its min_batch {low}"
                )
        if sum(mins) > self.global_batch:
            raise BatchSizeConfigError(
                f"global_batch={self.global_batch} is below the sum of min_batch ({sum(mins)})"
            )
        if sum(maxs) < self.global_batch:
            raise BatchSizeConfigError(
                f"global_batch={self.global_batch} exceeds the sum of max_batch ({sum(maxs)})"
            )

    def min_sizes(self) -> tuple[int, ...]:
        """Per-rank lower caps."""
        return _per_rank("min_batch", self.min_batch, self.world_size)

    def max_sizes(self) -> tuple[int, ...]:
        """Per-rank upper caps (``global_batch`` where not given)."""
        if self.max_batch is None:
            return (self.global_batch,) * self.world_size
        return _per_rank("max_batch", self.max_batch, self.world_size)


@dataclass(frozen=True)
class Measurement:
    """One rank's compute phase of one iteration.

    Attributes:
        rank: the rank that measured it.
        batch_size: the number of samples it processed.
        compute_seconds: wall time of its compute phase (forward, backward,
            update), excluding time spent waiting for other ranks.
    """

    rank: int
    batch_size: int
    compute_seconds: float


def aggregation_weights(sizes: Sequence[int]) -> list[float]:
    """Return ``b_i / B`` per rank: the weights that make the weighted sum of
    per-rank mean gradients equal to the mean gradient over all ``B`` samples."""
    if any(not _is_int(size) or size < 0 for size in sizes):
        raise BatchSizeError(f"batch sizes must be non-negative ints, got {list(sizes)}")
    total = sum(sizes)
    if total <= 0:
        raise BatchSizeError(f"batch sizes must sum to at least 1, got {list(sizes)}")
    return [size / total for size in sizes]


def _proportional_shares(
    total: int, weights: Sequence[float], mins: Sequence[int], maxs: Sequence[int]
) -> list[float]:
    """Real-valued ``clamp(λ·w_i, min_i, max_i)`` with ``λ`` chosen so they sum to ``total``.

    ``f(λ) = Σ clamp(λ·w_i)`` is piecewise linear and non-decreasing; walk its
    breakpoints in order until it reaches ``total`` and solve on that piece.
    """
    floor_sum = sum(mins)
    if total <= floor_sum:
        return [float(low) for low in mins]
    events: list[tuple[float, int, int]] = []  # (λ, +1 start / -1 stop, rank)
    for rank, (weight, low, high) in enumerate(zip(weights, mins, maxs)):
        events.append((low / weight, 1, rank))
        events.append((high / weight, -1, rank))
    events.sort()
    value, slope, lam = float(floor_sum), 0.0, 0.0
    solution = events[-1][0]
    for at, kind, rank in events:
        reached = value + slope * (at - lam)
        if slope > 0 and reached >= total:
            solution = lam + (total - value) / slope
            break
        value, lam = reached, at
        slope += kind * weights[rank]
    return [min(max(solution * w, float(lo)), float(hi)) for w, lo, hi in zip(weights, mins, maxs)]


def apportion(
    total: int,
    weights: Sequence[float],
    mins: Optional[Sequence[int]] = None,
    maxs: Optional[Sequence[int]] = None,
) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` within ``[mins, maxs]``.

    Real shares are ``clamp(λ·w_i, min_i, max_i)`` summing to ``total``; they
    are rounded by the largest-remainder method, ties going to the lower rank,
    so the result is deterministic and sums exactly to ``total``. Weights must
    be positive and finite; ``mins`` default to 0 and ``maxs`` to ``total``.
    """
    count = len(weights)
    low = list(mins) if mins is not None else [0] * count
    high = list(maxs) if maxs is not None else [total] * count
    if count == 0 or len(low) != count or len(high) != count:
        raise BatchSizeError(
            f"apportion needs matching non-empty weights/mins/maxs, got {count}/{len(low)}/{len(high)}"
        )
    for rank, weight in enumerate(weights):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise BatchSizeError(f"weight of rank {rank} must be positive and finite, got {weight!r}")
    if not sum(low) <= total <= sum(high) or any(lo > hi for lo, hi in zip(low, high)):
        raise BatchSizeError(f"cannot split {total} within mins {low} and maxs {high}")
    return _round_shares(total, _proportional_shares(total, weights, low, high), low, high)


def _round_shares(total: int, shares: Sequence[float], low: Sequence[int], high: Sequence[int]) -> list[int]:
    """Integers within ``[low, high]`` summing to ``total``, by largest remainder (ties to the lower rank)."""
    count = len(shares)
    sizes = [min(max(math.floor(share), lo), hi) for share, lo, hi in zip(shares, low, high)]
    remainders = [share - size for share, size in zip(shares, sizes)]
    deficit = total - sum(sizes)
    # Largest remainder first, lower rank on ties; repeat passes only to absorb
    # float round-off (normally one pass hands out every missing sample).
    order = sorted(range(count), key=lambda rank: (-remainders[rank], rank))
    while deficit > 0:
        for rank in order:
            if deficit > 0 and sizes[rank] < high[rank]:
                sizes[rank] += 1
                deficit -= 1
    while deficit < 0:
        for rank in reversed(order):
            if deficit < 0 and sizes[rank] > low[rank]:
                sizes[rank] -= 1
                deficit += 1
    return sizes


class _Scatter:
    """How far one rank's recent raw times fall from its model, robustly.

    Two parts, both from the ratios ``time / predicted time`` over the last
    measurements (as many as the moving averages effectively hold): their
    median's distance from 1, the bias of a model that still lags a change of
    speed, and the standard error of the ratios once each is clipped to within
    three robust sigmas (from their median absolute deviation) of the median.
    So one hiccup does not make the rank look unpredictable and hold back
    decisions for many periods, as a plain variance would.
    """

    MIN_POINTS = 3
    MAX_POINTS = 20
    _MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma
    _CLIP = 3.0  # ratios further than this many (robust) sigmas from the median count as that far

    def __init__(self, span: int) -> None:
        self._points: deque[tuple[int, float]] = deque(maxlen=span)

    def add(self, batch: int, seconds: float) -> None:
        self._points.append((batch, seconds))

    def error(self, a: float, k: float) -> float:
        """Seconds, at the latest batch size, for the line ``t = a + k·b``."""
        if not self._points:
            return 0.0
        ratios = [seconds / (a + k * batch) for batch, seconds in self._points]
        centre = statistics.median(ratios)
        limit = self._CLIP * self._MAD_TO_SIGMA * statistics.median(abs(r - centre) for r in ratios)
        clipped = [min(max(r, centre - limit), centre + limit) for r in ratios]
        spread = statistics.pstdev(clipped)
        latest = self._points[-1][0]
        return (abs(centre - 1.0) + spread / math.sqrt(len(ratios))) * (a + k * latest)


class _SizeRun:
    """One rank's run of steps at its current batch size: its steady time, and
    the shape ``a / k`` (samples) of its time line, read off where runs change.

    The steady time is the median of the run's last ``RUN`` times (the smaller
    of two; the time itself when alone). A hiccup (the OS preempting the rank,
    a collection pause) only makes a step slower and lasts one step; in a
    moving average of few measurements it shows up as a slower device, and an
    equal rank loses samples it should keep. A real change of speed persists
    and passes after two steps.

    Each time the rank's batch size changes by at least ``MIN_STEP`` of the larger
    size, the median of its last ``RUN`` times at the old size and of its first
    ``RUN`` at the new one (a median: one disturbed step must not make the shape)
    give a slope and an intercept. Steps this close in time
    compare the rank at one speed; a regression over its whole history mixes its
    speeds with its sizes, and once a rank has been held at one size long enough
    it cannot tell its fixed cost at all.
    """

    RUN = 3
    MIN_STEP = 0.2
    KEEP = 5

    def __init__(self) -> None:
        self._size = 0
        self._recent: deque[float] = deque(maxlen=self.RUN)  # the latest times at the current size
        self._before: Optional[tuple[int, float]] = None  # (size, median time) just before the change
        self.shapes: deque[float] = deque(maxlen=self.KEEP)

    def add(self, batch: int, seconds: float) -> None:
        if batch != self._size:
            full = len(self._recent) == self.RUN
            self._before = (self._size, statistics.median(self._recent)) if full else None
            self._size = batch
            self._recent.clear()
        self._recent.append(seconds)
        if len(self._recent) < self.RUN or self._before is None:
            return
        old_size, old_time = self._before
        self._before = None  # one estimate per change: the first RUN times after it
        if abs(batch - old_size) < self.MIN_STEP * max(batch, old_size):
            return
        k = (statistics.median(self._recent) - old_time) / (batch - old_size)
        a = old_time - k * old_size
        if k > 0 and a >= 0:
            self.shapes.append(a / k)

    def steady_time(self) -> float:
        """The latest time with a one-step hiccup taken out (after at least one :meth:`add`)."""
        return statistics.median(self._recent) if len(self._recent) == self.RUN else min(self._recent)


class _AffineFit:
    """Exponentially weighted least-squares fit of ``t = a + k·b`` for one rank.

    Observation ``j`` back weighs ``alpha·(1 - alpha)^j``; moments are divided
    by the total weight, so the first few observations count alike instead of
    the very first one standing in for the average (a bias-corrected moving
    average). Only the weighted moments are kept.
    """

    # Below this relative spread of the observed batch sizes (std / mean) the
    # slope is mostly measurement noise: use the proportional model instead.
    MIN_SPREAD = 0.2
    # A slope near zero (noise again) would make the intercept the whole time
    # and tip the rank between all samples and none: the intercept may explain
    # at most this share of the mean time.
    MAX_FIXED_SHARE = 0.8

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self._w = self._b = self._t = self._bb = self._bt = 0.0

    def __bool__(self) -> bool:
        return self._w > 0

    def add(self, batch: int, seconds: float) -> None:
        keep, a = 1.0 - self._alpha, self._alpha
        self._w = keep * self._w + a
        self._b = keep * self._b + a * batch
        self._t = keep * self._t + a * seconds
        self._bb = keep * self._bb + a * batch * batch
        self._bt = keep * self._bt + a * batch * seconds

    def _moments(self) -> tuple[float, float, float, float]:
        """Weighted means of batch and time, the batch's variance, and their covariance."""
        w = self._w
        mean_b, mean_t = self._b / w, self._t / w
        var_b = max(0.0, self._bb / w - mean_b * mean_b)
        return mean_b, mean_t, var_b, self._bt / w - mean_b * mean_t

    def coefficients(self, shape: Optional[float] = None) -> tuple[float, float]:
        """``(a, k)``: intercept (>= 0) and per-sample seconds (> 0).

        With a known ``shape`` (``a / k`` in samples, from size changes): the line
        of that shape through the rank's mean point, so only its speed is averaged.
        """
        mean_b, mean_t, var_b, cov = self._moments()
        if shape is not None:  # measured, not a fit through noise: no cap on the fixed share
            a = mean_t * shape / (shape + mean_b)
            return a, (mean_t - a) / mean_b
        if var_b > (self.MIN_SPREAD * mean_b) ** 2:
            k = cov / var_b
            a = min(mean_t - k * mean_b, self.MAX_FIXED_SHARE * mean_t)
            if k > 0 and a >= 0:
                return a, (mean_t - a) / mean_b  # the line still passes through the mean point
        return 0.0, mean_t / mean_b


def _equal_time_shares(
    total: int, models: Sequence[tuple[float, float]], mins: Sequence[int], maxs: Sequence[int]
) -> list[float]:
    """Real sizes ``clamp((T - a_i) / k_i, min_i, max_i)`` summing to ``total``.

    Their sum grows with the common finishing time ``T``; bisection finds it
    (a fixed number of steps of plain float arithmetic, so every rank gets
    the same answer from the same inputs).
    """
    def sizes(finish: float) -> list[float]:
        return [min(max((finish - a) / k, float(lo)), float(hi)) for (a, k), lo, hi in zip(models, mins, maxs)]

    low = min(a + k * lo for (a, k), lo in zip(models, mins))
    high = max(a + k * hi for (a, k), hi in zip(models, maxs))
    for _ in range(60):  # 2**-60 of the range: below float resolution for any real batch
        middle = 0.5 * (low + high)
        if sum(sizes(middle)) < total:
            low = middle
        else:
            high = middle
    # Solve the last piece exactly: ranks free at that T share what the clamped ones leave.
    shares = sizes(high)
    free = [r for r, ((a, k), lo, hi) in enumerate(zip(models, mins, maxs)) if lo < (high - a) / k < hi]
    if free:
        left = total - sum(shares[r] for r in range(len(shares)) if r not in free)
        finish = (left + sum(models[r][0] / models[r][1] for r in free)) / sum(1.0 / models[r][1] for r in free)
        for r in free:
            a, k = models[r]
            shares[r] = min(max((finish - a) / k, float(mins[r])), float(maxs[r]))
    return shares


class _TimeCurve:
    """Recent ``(batch size, moving average of time)`` points of one rank and a
    monotone piecewise-linear model through them.

    Each point's average is bias-corrected like :class:`_AffineFit`'s: its
    first few measurements count alike (the first one alone would otherwise
    stand for the point until many more arrive at that exact size).
    """

    def __init__(self, alpha: float, capacity: int) -> None:
        self._alpha = alpha
        self._capacity = capacity
        # batch -> decayed (weight·seconds, weight), in recency order; a point's average is their ratio
        self._points: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._points)

    def add(self, batch: int, seconds: float) -> None:
        keep = 1.0 - self._alpha
        total, weight = self._points.pop(batch, (0.0, 0.0))
        self._points[batch] = (keep * total + self._alpha * seconds, keep * weight + self._alpha)
        while len(self._points) > self._capacity:
            self._points.popitem(last=False)

    def latest(self) -> tuple[int, float]:
        batch, (total, weight) = next(reversed(self._points.items()))
        return batch, total / weight

    def predict(self, batch: float) -> float:
        """Predicted seconds for ``batch`` samples.

        Interpolates linearly between points made non-decreasing (a running
        max over increasing batch sizes, since more samples never take less
        time). Outside the observed range it extrapolates conservatively, so
        that one decision never moves many samples on a guess: below the
        smallest point with the first segment's slope, above the largest one
        with the larger of the last segment's slope and the average time per
        sample ``t/b`` there. A single point means time proportional to ``b``.
        """
        points = sorted((b, total / weight) for b, (total, weight) in self._points.items())
        batches = [float(b) for b, _ in points]
        times: list[float] = []
        for _, seconds in points:
            times.append(max(seconds, times[-1]) if times else seconds)
        if len(points) == 1:
            return times[0] * batch / batches[0]
        if batch <= batches[0]:
            slope = (times[1] - times[0]) / (batches[1] - batches[0])
            return max(0.0, times[0] - slope * (batches[0] - batch))
        if batch >= batches[-1]:
            slope = max(
                (times[-1] - times[-2]) / (batches[-1] - batches[-2]), times[-1] / batches[-1]
            )
            return times[-1] + slope * (batch - batches[-1])
        for index in range(1, len(batches)):
            if batch <= batches[index]:
                left, right = batches[index - 1], batches[index]
                fraction = (batch - left) / (right - left)
                return times[index - 1] + fraction * (times[index] - times[index - 1])
        return times[-1]  # unreachable: batch < batches[-1] was handled above


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
        self._curves = [_TimeCurve(config.ema_alpha, config.history) for _ in range(config.world_size)]
        self._fits = [_AffineFit(config.ema_alpha) for _ in range(config.world_size)]
        self._runs = [_SizeRun() for _ in range(config.world_size)]
        span = max(_Scatter.MIN_POINTS, min(_Scatter.MAX_POINTS, round((2.0 - config.ema_alpha) / config.ema_alpha)))
        self._scatters = [_Scatter(span) for _ in range(config.world_size)]
        self._skipped = [0] * config.world_size  # measurements left out so far (warmup)
        self._last_iteration: Optional[int] = None

    def _check_assignment(self, sizes: Sequence[int]) -> None:
        cfg = self._config
        if len(sizes) != cfg.world_size or sum(sizes) != cfg.global_batch or any(
            not _is_int(size) or not lo <= size <= hi
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
            if not _is_int(item.rank) or not 0 <= item.rank < self._config.world_size:
                raise MeasurementError(
                    f"measurement rank {item.rank!r} outside [0, {self._config.world_size})"
                )
            if not _is_int(item.batch_size) or item.batch_size < 1:
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
        proposed and adopted if it passes the hysteresis test; otherwise the
        current sizes are returned unchanged.
        """
        if not _is_int(iteration) or iteration < 0:
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
        elif self._beyond_hysteresis(proposal):
            logger.info("iteration %d: batch sizes %s -> %s", iteration, list(self._sizes), proposal)
            self._sizes = tuple(proposal)
        return list(self._sizes)

    def _beyond_hysteresis(self, proposal: Sequence[int]) -> bool:
        h = self._config.hysteresis
        return any(abs(new - old) > max(1.0, h * old) for new, old in zip(proposal, self._sizes))

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
            shares = _equal_time_shares(cfg.global_batch, models, self._mins, self._maxs)
            return _round_shares(cfg.global_batch, shares, self._mins, self._maxs)
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
