"""Deterministic straggler injection for experiments on heterogeneous clusters.

A spec such as ``"3:3.0"`` or ``"1:2.0,3:3.0"`` (``rank:factor``) makes the
listed ranks run ``factor`` times slower than they really are: after each
compute phase that took ``t`` seconds, :meth:`Straggler.slow_down` performs
``(factor - 1) × t`` seconds of extra work.

Why busy work and not ``time.sleep``: a sleeping straggler releases the CPU or
GPU, so a co-located job (the very thing Crossover schedules) would get the
device for free during the "slow" part, and a slower device does not behave
like that. Repeated small matrix multiplications on the rank's own device
contend for it like real compute does. Why proportional to the measured
compute time: the slowdown then follows the model's real cost (batch size,
contention) instead of a constant delay, which is what a slower device does.

The clock and the unit of work are injectable, so tests run instantly and
deterministically with a fake clock.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Callable, Optional, Union

__all__ = [
    "Drift",
    "Stall",
    "Straggler",
    "StragglerSpecError",
    "make_matmul_work",
    "parse_straggler_spec",
]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Work = Callable[[], None]


class StragglerSpecError(ValueError):
    """A straggler spec string or factor is malformed."""


def parse_straggler_spec(spec: str) -> dict[int, float]:
    """Parse ``"rank:factor[,rank:factor...]"`` into ``{rank: factor}``.

    Whitespace around items is ignored and an empty (or blank) spec means no
    straggler. Ranks are non-negative ints listed at most once; factors are
    finite numbers ``>= 1`` (1 means no slowdown).
    """
    result: dict[int, float] = {}
    if not spec.strip():
        return result
    for item in spec.split(","):
        text = item.strip()
        rank_text, sep, factor_text = text.partition(":")
        if not sep:
            raise StragglerSpecError(f"straggler item {text!r} in {spec!r} is not 'rank:factor'")
        try:
            rank = int(rank_text.strip())
        except ValueError:
            raise StragglerSpecError(
                f"straggler rank {rank_text.strip()!r} in {spec!r} is not an integer"
            ) from None
        try:
            factor = float(factor_text.strip())
        except ValueError:
            raise StragglerSpecError(
                f"straggler factor {factor_text.strip()!r} in {spec!r} is not a number"
            ) from None
        if rank < 0:
            raise StragglerSpecError(f"straggler rank {rank} in {spec!r} must be >= 0")
        if not math.isfinite(factor) or factor < 1.0:
            raise StragglerSpecError(
                f"straggler factor {factor_text.strip()!r} for rank {rank} must be finite and >= 1"
            )
        if rank in result:
            raise StragglerSpecError(f"straggler rank {rank} appears twice in {spec!r}")
        result[rank] = factor
    return result


def make_matmul_work(device: str = "cpu", size: int = 64) -> Work:
    """Return one unit of busy work: a ``size × size`` float32 matmul on ``device``.

    The unit is small (tens of microseconds on a CPU) so that the total extra
    time overshoots its target by little. On CUDA it waits for the kernel, so
    the clock measures device time. torch is imported here, lazily.
    """
    import torch

    target = torch.device(device)
    left = torch.rand(size, size, device=target)
    right = torch.rand(size, size, device=target)

    def work() -> None:
        torch.mm(left, right)
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    return work


class Straggler:
    """Makes one rank ``factor`` times slower by adding proportional busy work.

    Args:
        factor: slowdown factor, ``>= 1``; 1 makes :meth:`slow_down` a no-op.
        clock: monotonic seconds, ``time.perf_counter`` by default.
        work: one unit of busy work; :func:`make_matmul_work` (CPU) by default,
            created on first use.

    Over- or undershoot of one call (at most one unit of work) is carried into
    the next call, so the cumulative extra time tracks
    ``(factor - 1) × cumulative compute time``.
    """

    def __init__(
        self, factor: float, *, clock: Clock = time.perf_counter, work: Optional[Work] = None
    ) -> None:
        if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1.0:
            raise StragglerSpecError(f"straggler factor must be finite and >= 1, got {factor!r}")
        self._factor = float(factor)
        self._clock = clock
        self._work = work
        self._carry = 0.0
        self._total_extra = 0.0

    @classmethod
    def for_rank(
        cls,
        spec: Union[str, Mapping[int, float]],
        rank: int,
        *,
        clock: Clock = time.perf_counter,
        work: Optional[Work] = None,
    ) -> Straggler:
        """The straggler of ``rank`` under ``spec`` (factor 1, a no-op, if unlisted)."""
        factors = parse_straggler_spec(spec) if isinstance(spec, str) else dict(spec)
        factor = factors.get(rank, 1.0)
        if factor != 1.0:
            logger.info("rank %d is an injected straggler, factor %.2f", rank, factor)
        return cls(factor, clock=clock, work=work)

    @property
    def factor(self) -> float:
        """The slowdown factor."""
        return self._factor

    @property
    def active(self) -> bool:
        """Whether this straggler adds any work."""
        return self._factor > 1.0

    @property
    def total_extra_seconds(self) -> float:
        """Extra seconds spent in :meth:`slow_down` so far, per the clock."""
        return self._total_extra

    def slow_down(self, real_compute_seconds: float) -> float:
        """Busy-work for ``(factor - 1) × real_compute_seconds``; return the seconds spent.

        Call it right after the compute phase it stretches, while the rank
        still holds its device.
        """
        if not math.isfinite(real_compute_seconds) or real_compute_seconds < 0:
            raise ValueError(
                f"real_compute_seconds must be finite and >= 0, got {real_compute_seconds!r}"
            )
        if not self.active:
            return 0.0
        target = (self._factor - 1.0) * real_compute_seconds + self._carry
        if target <= 0:
            self._carry = target
            return 0.0
        if self._work is None:
            self._work = make_matmul_work()
        start = self._clock()
        elapsed = 0.0
        while elapsed < target:
            self._work()
            elapsed = self._clock() - start
        self._carry = target - elapsed
        self._total_extra += elapsed
        return elapsed


class Stall:
    """A rank that now and then stops for seconds (a device stalled by a co-tenant, a paging storm):
    ``"3:1.5:0.05"`` (``rank:seconds:probability``) makes rank 3 stall 1.5 s after each step with
    probability 0.05, from a seeded generator so every run stalls at the same steps."""

    def __init__(self, seconds: float = 0.0, probability: float = 0.0, seed: int = 0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        import random

        if seconds < 0 or not 0.0 <= probability <= 1.0:
            raise StragglerSpecError(f"a stall needs seconds >= 0 and a probability in [0, 1], not "
                                     f"{seconds}, {probability}")
        self.seconds, self.probability = seconds, probability
        self._rng = random.Random(seed)
        self._sleep = sleep
        self.stalled_s = 0.0

    @classmethod
    def for_rank(cls, spec: str, rank: int, seed: int = 0, **kwargs: object) -> Stall:
        """The stall a spec gives ``rank`` (none when the spec does not name it)."""
        if not spec.strip():
            return cls()
        try:
            who, seconds, probability = spec.split(":")
            target, pause, chance = int(who), float(seconds), float(probability)
        except ValueError:
            raise StragglerSpecError(f"stall spec {spec!r} is not 'rank:seconds:probability'") from None
        return cls(pause, chance, seed, **kwargs) if target == rank else cls()  # type: ignore[arg-type]

    def after_step(self) -> float:
        """Maybe stall now; the seconds stalled."""
        if self.probability and self._rng.random() < self.probability:
            self._sleep(self.seconds)
            self.stalled_s += self.seconds
            return self.seconds
        return 0.0


class Drift:
    """A rank whose pace changes during the run, as a shared node's does when other jobs come and go:
    ``"5:3@20-60,6:2@50-110"`` (``rank:factor@from-to``, seconds of the run's own training time) makes rank 5
    three times slower from 20 s to 60 s, then itself again, and rank 6 twice as slow from 50 s to 110 s. A rank
    may be listed again for another window; windows of one rank must not overlap. The slowing is a
    :class:`Straggler`'s, with the same unit of work."""

    def __init__(self, windows: list[tuple[float, float, float]], *, clock: Clock = time.perf_counter,
                 work: Optional[Work] = None) -> None:
        ordered = sorted(windows, key=lambda w: w[1])
        for (_, _, end), (_, start, _) in zip(ordered, ordered[1:]):
            if start < end:
                raise StragglerSpecError(f"drift windows {ordered} overlap")
        self.windows = ordered
        self._stragglers = [Straggler(factor, clock=clock, work=work) for factor, _, _ in ordered]

    @classmethod
    def for_rank(cls, spec: str, rank: int, *, clock: Clock = time.perf_counter,
                 work: Optional[Work] = None) -> Drift:
        """The drift a spec gives ``rank`` (none when the spec does not name it)."""
        windows = [w for r, w in parse_drift_spec(spec) if r == rank]
        if windows:
            logger.info("rank %d drifts: %s", rank, ", ".join(f"{f:g}x {a:g}-{b:g} s" for f, a, b in windows))
        return cls(windows, clock=clock, work=work)

    def factor_at(self, at_s: float) -> float:
        """The slowdown at ``at_s`` seconds of training (1: the rank's own pace)."""
        return next((factor for factor, start, end in self.windows if start <= at_s < end), 1.0)

    def slow_down(self, real_compute_seconds: float, at_s: float) -> float:
        """Stretch a compute phase that ended at ``at_s`` seconds of training by its window's factor."""
        for straggler, (_, start, end) in zip(self._stragglers, self.windows):
            if start <= at_s < end:
                return straggler.slow_down(real_compute_seconds)
        return 0.0


def parse_drift_spec(spec: str) -> list[tuple[int, tuple[float, float, float]]]:
    """``"rank:factor@from-to,..."`` into ``[(rank, (factor, from_s, to_s)), ...]``; blank: no drift."""
    out: list[tuple[int, tuple[float, float, float]]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            head, window = item.split("@")
            who, factor_text = head.split(":")
            start_text, end_text = window.split("-")
            rank, factor, start, end = int(who), float(factor_text), float(start_text), float(end_text)
        except ValueError:
            raise StragglerSpecError(f"drift item {item!r} in {spec!r} is not 'rank:factor@from-to'") from None
        if rank < 0 or not math.isfinite(factor) or factor < 1.0 or not 0 <= start < end:
            raise StragglerSpecError(f"drift item {item!r}: a rank >= 0, a factor >= 1 and 0 <= from < to")
        out.append((rank, (factor, start, end)))
    return out

