"""The device model's arithmetic: how fast each computing context progresses, and when each finishes.

Pure logic, no I/O: `server` drives it with the wall clock, tests with made-up times.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["DeviceModel", "DeviceParams", "compute_rate"]

_DONE_S = 1e-9  # work left below this is finished (float residue of rate x time)


def compute_rate(computing: int, comm_beside: bool, switch_penalty: float, interference: float) -> float:
    """The speed (1 = alone) of each of `computing` contexts on one device; the simulator's rule too.

    k > 1 contexts alternate, each losing `switch_penalty` of its slices to
    switching in; an allreduce beside them slows all compute by 1 + `interference`.
    """
    if computing <= 0:
        return 0.0
    rate = 1.0 if computing == 1 else 1.0 / (computing * (1.0 + switch_penalty))
    return rate / (1.0 + interference) if comm_beside else rate


@dataclass(frozen=True)
class DeviceParams:
    """How one GPU without MPS serves several processes' contexts.

    `slice_us`: the time slice a context runs before the next one is switched in;
    `switch_us`: what one switch costs (save and restore of a context);
    `interference`: while an allreduce runs beside it, compute progresses at 1/(1 + this).
    """

    slice_us: float = 1024.0
    switch_us: float = 40.0
    interference: float = 0.19

    def __post_init__(self) -> None:
        if not 10.0 <= self.slice_us <= 1e6:
            raise ValueError(f"slice_us={self.slice_us} is outside 10..1e6")
        if not 0.0 <= self.switch_us < self.slice_us:
            raise ValueError(f"switch_us={self.switch_us} must be ≥ 0 and shorter than the slice ({self.slice_us})")
        if not 0.0 <= self.interference <= 10.0:
            raise ValueError(f"interference={self.interference} is outside 0..10")

    @property
    def switch_penalty(self) -> float:
        """The share of a slice lost to switching in, when contexts alternate."""
        return self.switch_us / self.slice_us

    def compute_rate(self, computing: int, comm_beside: bool) -> float:
        """The speed (1 = alone, nothing else on the device) of each of `computing` contexts."""
        return compute_rate(computing, comm_beside, self.switch_penalty, self.interference)

    def describe(self) -> str:
        return (f"slice {self.slice_us:g} µs, switch {self.switch_us:g} µs, "
                f"compute +{100 * self.interference:.0f}% beside an allreduce")


class DeviceModel:
    """One device's contexts: the work each has left, and who is in an allreduce.

    A fluid version of round-robin time slicing: over any stretch longer than a
    few slices (a compute phase is tens to hundreds of them) each busy context
    gets its share. Every change (`submit`, `set_comm`, `remove`) first brings
    the work left up to `now`.
    """

    def __init__(self, params: DeviceParams) -> None:
        self.params = params
        self._left: dict[Hashable, float] = {}  # computing contexts: device-seconds still to do
        self._comm: set[Hashable] = set()
        self._since = 0.0
        self._rate = 0.0
        self.busy_s = 0.0  # time with at least one context computing
        self.shared_s = 0.0  # time with two or more

    @property
    def computing(self) -> int:
        return len(self._left)

    def _advance(self, now: float) -> None:
        dt = max(0.0, now - self._since)
        if self._left and dt:
            self.busy_s += dt
            if len(self._left) > 1:
                self.shared_s += dt
            for ctx in self._left:
                self._left[ctx] -= dt * self._rate
        self._since = max(self._since, now)

    def _rerate(self) -> None:
        self._rate = self.params.compute_rate(len(self._left), bool(self._comm))

    def submit(self, ctx: Hashable, work_s: float, now: float) -> None:
        """`ctx` starts `work_s` seconds (at full speed) of compute; it must not be computing already."""
        if ctx in self._left:
            raise ValueError(f"context {ctx!r} is already computing")
        if work_s < 0:
            raise ValueError(f"work {work_s} s is negative")
        self._advance(now)
        self._left[ctx] = work_s
        self._rerate()

    def set_comm(self, ctx: Hashable, active: bool, now: float) -> None:
        """`ctx`'s job has an allreduce in flight (or no longer has)."""
        self._advance(now)
        if active:
            self._comm.add(ctx)
        else:
            self._comm.discard(ctx)
        self._rerate()

    def remove(self, ctx: Hashable, now: float) -> None:
        """`ctx` is gone (its process closed the connection): drop its work and its allreduce."""
        self._advance(now)
        self._left.pop(ctx, None)
        self._comm.discard(ctx)
        self._rerate()

    def finished(self, now: float) -> list[Hashable]:
        """The contexts whose work is done by `now`, in the order they were submitted; they stop computing."""
        self._advance(now)
        done = [ctx for ctx, left in self._left.items() if left <= _DONE_S]
        for ctx in done:
            del self._left[ctx]
        if done:
            self._rerate()
        return done

    def next_finish(self) -> float | None:
        """When the next context finishes if nothing changes; None when none computes."""
        if not self._left or self._rate <= 0:
            return None
        return self._since + max(0.0, min(self._left.values())) / self._rate
