"""Per-rank estimates the LB-BSP controller predicts compute times from.

:class:`AffineFit` (the ``ema`` line ``t = a + k·b``), :class:`SizeRun` (a
rank's steady time and the fixed cost's shape read off its size changes),
:class:`TimeCurve` (the ``numerical`` method's piecewise-linear curve) and
:class:`Scatter` (how far a rank's times fall from its model).
"""
from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from typing import Optional

__all__ = ["AffineFit", "Scatter", "SizeRun", "TimeCurve"]


class Scatter:
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


class SizeRun:
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


class AffineFit:
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


class TimeCurve:
    """Recent ``(batch size, moving average of time)`` points of one rank and a
    monotone piecewise-linear model through them.

    Each point's average is bias-corrected like :class:`AffineFit`'s: its
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
