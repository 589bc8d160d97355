"""The ranks' measurement exchange: when it starts and is read, what it feeds the controller, its drain at exit.

Cross-rank agreement: every rank starts the exchange after the same step (a
period boundary) and reads it ``SHARE_LAG`` steps later (1 with period 1),
so all ranks feed identical measurement lists to identical controllers at
the same step and adopt the same sizes for the same next global batch.
Reading it later hides the allgather behind those steps' compute.
"""
from __future__ import annotations

import atexit
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from crossover.plugins.aggregation.lbbsp.config import Measurement
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.process_state import STATE

__all__ = ["SHARE_LAG", "apply_measurements", "guard_shutdown", "observe_steps", "share_read_after",
           "share_starts", "steps_of"]

logger = logging.getLogger(__name__)

SHARE_LAG = 2  # steps between starting the measurement allgather and reading it


def share_starts(iteration: int, period: int) -> bool:
    """Every rank starts the measurement exchange after the last step of a period."""
    return (iteration + 1) % period == 0


def share_read_after(started: int, period: int) -> int:
    """The step after which the exchange started after step ``started`` is read (and decided on)."""
    return started + min(SHARE_LAG, period)


def apply_measurements(controller: BatchSizeController, rows: Sequence[Sequence[Sequence[float]]]) -> None:
    """Feed gathered measurements to ``controller``'s estimates, iteration by iteration.

    ``rows[rank][k] = (iteration, batch, compute seconds)``; every rank lists
    the same iterations in the same order. Entries with no samples or no
    valid time (the first iteration, an empty batch) are left out.
    """
    observe_steps(controller, steps_of(rows))


def steps_of(rows: Sequence[Sequence[Sequence[float]]]) -> list[list[tuple[int, float]]]:
    """``rows[rank][k] = (iteration, batch, seconds)`` turned around: per iteration, each rank's
    ``(batch, seconds)``, the form the controller reads and ``lbbsp_stats()["trace"]`` keeps."""
    return [[(int(row[column][1]), float(row[column][2])) for row in rows]
            for column in range(len(rows[0]) if rows else 0)]


def observe_steps(controller: BatchSizeController, steps: Sequence[Sequence[Sequence[float]]]) -> None:
    """Feed per-iteration ``[rank] = (batch, seconds)`` lists to the controller, skipping unmeasured entries."""
    for step in steps:
        controller.observe([Measurement(rank, int(batch), float(seconds)) for rank, (batch, seconds) in enumerate(step)
                            if batch >= 1 and math.isfinite(seconds) and seconds > 0])


class Drainable(Protocol):
    """An owner of an exchange that may still be in flight at exit."""

    hvd: Any

    def drain(self, timeout: float) -> None: ...


# A share started at a job's last step is never read by the loop. If a fast
# rank then shut Horovod down (an explicit ``hvd.shutdown()`` or Horovod's
# own exit handler), a slower rank would submit its half to a dead Horovod and
# crash. So every rank first waits for its own in-flight share: that returns
# once all ranks have submitted theirs.
_DRAIN_TIMEOUT_S = 30.0


def _drain_pending() -> None:
    for owner in list(STATE.pending):
        owner.drain(_DRAIN_TIMEOUT_S)
    STATE.pending.clear()


def guard_shutdown(owner: Drainable) -> None:
    """Drain ``owner``'s in-flight exchange before Horovod shuts down (at exit or on ``hvd.shutdown()``)."""
    STATE.pending.add(owner)
    if STATE.drain_installed:
        return
    STATE.drain_installed = True
    # atexit is LIFO: registered after hvd.init(), this runs before Horovod's own exit handler.
    atexit.register(_drain_pending)
    # ``hvd.shutdown`` is ``mpi_ops.shutdown``, which resets the torch handle table before it
    # calls the common shutdown: the drain must come before both, so both names are wrapped.
    hvd = owner.hvd
    for module in (hvd, getattr(hvd, "mpi_ops", None)):
        original = getattr(module, "shutdown", None)
        if module is not None and original is not None:
            module.shutdown = _draining(original)


def _draining(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(*args: Any, **kwargs: Any) -> Any:
        _drain_pending()
        return original(*args, **kwargs)

    return shutdown
