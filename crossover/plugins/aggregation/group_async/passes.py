"""Elementwise passes over a model's worth of float32 values, split across the parameter service's threads.

The parameter service's add of an update and its copy of the global model into
an answer are bound by memory bandwidth, which one core does not fill: on the
2-core development VM, 10 M values take 9.9 ms to add and 6.9 ms to copy on one
thread, 6.0 and 1.9 ms on two. numpy's ufuncs release the GIL, so each thread
runs its own contiguous piece at once. While the service works a pass, the
group whose exchange it is waits for the answer, so the cores it borrows are
mostly the group's own.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np

__all__ = ["Passes", "default_threads"]

MIN_PIECE = 1 << 19
"""Values per thread below which a pass stays on one thread (handing a piece over costs more than it saves)."""


def default_threads() -> int:
    """The service's threads for its passes: the cores this process may run on, at most 4 (a pass saves
    little beyond that, as memory bandwidth runs out)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class Passes:
    """Runs ``fn(piece)`` over contiguous pieces of ``range(n)``, one per thread, this thread taking the first."""

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self.threads = threads
        self._pool: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="crossover-pass") if threads > 1 else None)

    def run(self, fn: Callable[[slice], object], n: int) -> None:
        pieces = max(1, min(self.threads, n // MIN_PIECE))
        if pieces == 1 or self._pool is None:
            fn(slice(0, n))
            return
        step = -(-n // pieces)
        others = [self._pool.submit(fn, slice(start, start + step)) for start in range(step, n, step)]
        try:
            fn(slice(0, step))
        finally:
            wait(others)  # every piece has stopped writing before any error is raised
        for other in others:
            other.result()

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = a + b`` (``out`` may be ``a``)."""
        self.run(lambda s: np.add(a[s], b[s], out=out[s]), out.size)
        return out

    def subtract(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = a - b`` (``out`` may be ``a``)."""
        self.run(lambda s: np.subtract(a[s], b[s], out=out[s]), out.size)
        return out

    def copy(self, src: np.ndarray, out: np.ndarray) -> np.ndarray:
        self.run(lambda s: np.copyto(out[s], src[s]), out.size)
        return out
