"""The emulated device's memory: one budget, each context's allocator pool in it, and a cap per pool.

A context's pool grows as a caching allocator's does (to what its work needs and no
further, never shrinking below what is in use) and its first allocation creates its
context, which holds `context_bytes` of the device outside the pool, as a CUDA context
and NCCL's buffers do. A pool may be capped (`set_limit`, torch's per-process memory
fraction); an allocation past the cap, or past what the device has free, is refused
with the reason, as torch's allocator raises out-of-memory.

Pure logic, no I/O: `server` answers a rank's `alloc`, `limit` and `footprint` lines from it.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["MemoryBudget", "Refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why an allocation failed: `cap` (the pool's limit) or `device` (nothing free), with the figures."""

    reason: str
    pool: int
    limit: int
    free: int


class MemoryBudget:
    """`total` bytes shared by contexts, each with a pool and, once it allocated, `context_bytes` outside it."""

    def __init__(self, total: int, context_bytes: int = 0) -> None:
        if total < 0 or context_bytes < 0:
            raise ValueError("memory sizes must be non-negative")
        self.total = total
        self.context_bytes = context_bytes
        self._pools: dict[Hashable, int] = {}
        self._limits: dict[Hashable, int] = {}

    @property
    def used(self) -> int:
        return sum(self._pools.values()) + self.context_bytes * len(self._pools)

    def free(self) -> int:
        return max(0, self.total - self.used) if self.total else 1 << 62

    def grow(self, ctx: Hashable, need: int) -> Refusal | None:
        """Let `ctx`'s pool reach `need` bytes (no change if it holds that already); None when it did."""
        pool = self._pools.get(ctx)
        more = max(0, need - (pool or 0)) + (self.context_bytes if pool is None else 0)
        limit = self._limits.get(ctx)
        if limit is not None and need > limit:
            return Refusal("cap", pool or 0, limit, self.free())
        if more > self.free():
            return Refusal("device", pool or 0, -1 if limit is None else limit, self.free())
        self._pools[ctx] = max(need, pool or 0)
        return None

    def set_limit(self, ctx: Hashable, limit: int | None) -> None:
        """Cap `ctx`'s pool at `limit` bytes (None: no cap); what it holds already stays."""
        if limit is None:
            self._limits.pop(ctx, None)
        else:
            self._limits[ctx] = limit

    def footprint(self, ctx: Hashable) -> tuple[int, int] | None:
        """(pool, outside) of `ctx`; None before its first allocation (no context yet)."""
        pool = self._pools.get(ctx)
        return None if pool is None else (pool, self.context_bytes)

    def remove(self, ctx: Hashable) -> None:
        """The context ended: its pool and its context are the device's again."""
        self._pools.pop(ctx, None)
        self._limits.pop(ctx, None)
