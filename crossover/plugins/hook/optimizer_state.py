"""Horovod's `broadcast_optimizer_state` for the plugin's own optimizers (Adasum, group_async).

Horovod fills an empty optimizer's state by stepping it once with zero
gradients, on each rank whose state is empty, and for anything but its own
`DistributedOptimizer` it calls the optimizer's own `step()`. The plugin's
optimizers combine ranks inside `step()`. In the usual resume, only rank 0
loads a checkpoint, so the other ranks would step (a collective) while rank 0
does not, and the job would hang. For those optimizers this hook broadcasts the
wrapped optimizer's state instead (its first step is local), then, for
group_async, rank 0's record of where group training stands
(`GroupRuntime.state_dict`), before training has started. Every other
optimizer goes to Horovod's own function unchanged.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from crossover.plugins.hook.composed_optimizer import ComposedOptimizer
from crossover.plugins.hook.runtime import RUNTIME

__all__ = ["install"]

_log = logging.getLogger(__name__)


def install() -> None:
    """Replace `horovod.torch.broadcast_optimizer_state` (and its home module's name); idempotent."""
    if RUNTIME.original_broadcast is not None:
        return
    import horovod.torch as hvd
    import horovod.torch.functions as functions

    original = functions.broadcast_optimizer_state
    RUNTIME.original_broadcast = original

    @functools.wraps(original)
    def broadcast_optimizer_state(optimizer: Any, root_rank: int, *args: Any, **kwargs: Any) -> None:
        if not isinstance(optimizer, ComposedOptimizer):
            return original(optimizer, root_rank, *args, **kwargs)
        _broadcast_composed(hvd, original, optimizer, root_rank, *args, **kwargs)
        return None

    hvd.broadcast_optimizer_state = broadcast_optimizer_state
    functions.broadcast_optimizer_state = broadcast_optimizer_state


def _broadcast_composed(hvd: Any, original: Callable[..., Any], optimizer: ComposedOptimizer, root_rank: int,
                        *args: Any, **kwargs: Any) -> None:
    original(optimizer.optimizer, root_rank, *args, **kwargs)
    optimizer.share_inner_state()
    runtime = getattr(optimizer, "runtime", None)
    if runtime is not None and not runtime.started:  # every rank knows the same: the start is a boundary
        state = hvd.broadcast_object(runtime.state_dict(), root_rank=root_rank,
                                     name="crossover.group_async.optimizer_state")
        runtime.load_state_dict(state)
        _log.debug("group_async: state from rank %d loaded", root_rank)
