"""The LB-BSP controller's settings and its input: :class:`BatchSizeConfig`, :class:`Measurement`, the errors."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from crossover.errors import CrossoverError

__all__ = [
    "BatchSizeConfig",
    "BatchSizeConfigError",
    "BatchSizeError",
    "Measurement",
    "MeasurementError",
    "Method",
    "is_int",
]

Method = Literal["ema", "numerical"]
_METHODS = ("ema", "numerical")


class BatchSizeError(CrossoverError, ValueError):
    """Base class of the errors raised by this module."""


class BatchSizeConfigError(BatchSizeError):
    """A :class:`BatchSizeConfig` field (or initial assignment) is invalid."""


class MeasurementError(BatchSizeError):
    """A :class:`Measurement` does not describe a real compute phase."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_rank(
    name: str, value: Union[int, Sequence[int]], world_size: int
) -> tuple[int, ...]:
    if is_int(value):
        values: tuple[int, ...] = (int(value),) * world_size  # type: ignore[arg-type]
    else:
        values = tuple(value)  # type: ignore[arg-type]
        if len(values) != world_size:
            raise BatchSizeConfigError(
                f"{name} has {len(values)} entries, expected world_size={world_size}"
            )
    for rank, item in enumerate(values):
        if not is_int(item):
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
            if not is_int(value):
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
