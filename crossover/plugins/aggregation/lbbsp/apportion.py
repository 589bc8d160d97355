"""Splitting a global batch into integer per-rank sizes, deterministically on every rank.

All arithmetic is plain Python floats in a fixed order and rounding is by
largest remainder with ties broken by rank, so every rank computes the same
list from the same inputs without further communication.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from crossover.plugins.aggregation.lbbsp.config import BatchSizeError, is_int

__all__ = ["aggregation_weights", "apportion", "equal_time_shares", "round_shares"]


def aggregation_weights(sizes: Sequence[int]) -> list[float]:
    """Return ``b_i / B`` per rank: the weights that make the weighted sum of
    per-rank mean gradients equal to the mean gradient over all ``B`` samples."""
    if any(not is_int(size) or size < 0 for size in sizes):
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
    return round_shares(total, _proportional_shares(total, weights, low, high), low, high)


def round_shares(total: int, shares: Sequence[float], low: Sequence[int], high: Sequence[int]) -> list[int]:
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


def equal_time_shares(
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
