"""Hand the device back whenever a rank waits for other ranks inside Horovod.

Every blocking Horovod call of `horovod.torch` ends in one function,
`mpi_ops.synchronize(handle)`: allreduce, grouped_allreduce, allgather,
broadcast, alltoall, reducescatter (and their `*_async` handles when a script
synchronizes them), `join`, `barrier`, and everything built on them
(`broadcast_parameters`, `broadcast_optimizer_state`, `broadcast_object`,
`allgather_object`, SyncBatchNorm, elastic state sync), on any process set.
Wrapping it (and `poll`, `shutdown`) is enough for a holder to yield its
device for the length of every such wait, whoever calls it: a script, the
optimizer, or Crossover's own aggregation.

`poll` does not block, but a loop on it does: a poll that finds the
operation unfinished yields the device, and the rank asks for it again when
a poll finds it done (or at its next phase point). `shutdown` may wait for
the other ranks too; the device is asked for again only if the rank trains on
(elastic re-initialisation).

`allreduce_async_` and `grouped_allreduce_async_` go through the rank's
`HostStager` when it has one (`CROSSOVER_HOST_STAGING`), for CUDA tensors while
another rank shares the device; `synchronize` and `poll` then take its handles.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from crossover.plugins.hook.host_staging import StagedHandle, stages
from crossover.plugins.hook.phase_reporter import PhaseReporter
from crossover.plugins.hook.runtime import RUNTIME

__all__ = ["install", "uninstall"]

_log = logging.getLogger(__name__)


def install(phases: PhaseReporter, on_init: Callable[[], None] | None = None) -> None:
    """Route Horovod's waits through `phases` (the latest call wins); idempotent.

    `on_init` runs after every later `init` (an elastic reset re-initialises Horovod).
    """
    import horovod.torch.mpi_ops as mpi_ops

    RUNTIME.phases = phases
    RUNTIME.on_init = on_init
    if not RUNTIME.waits_hooked:
        RUNTIME.original_waits = {name: getattr(mpi_ops, name) for name in _WRAPPERS}
        _swap({RUNTIME.original_waits[name]: wrapper for name, wrapper in _WRAPPERS.items()})
        RUNTIME.waits_hooked = True


def uninstall() -> None:
    """Restore Horovod's functions everywhere they were replaced (tests use it)."""
    if RUNTIME.waits_hooked:
        _swap({wrapper: RUNTIME.original_waits[name] for name, wrapper in _WRAPPERS.items()})
        RUNTIME.waits_hooked = False
    RUNTIME.phases = None
    RUNTIME.on_init = None


def _swap(replace: dict[Callable[..., Any], Callable[..., Any]]) -> None:
    """Replace each function in every loaded `horovod.torch` module that imported it by name."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "horovod.torch" or name.startswith("horovod.torch.")):
            continue
        for attr in _WRAPPERS:
            current = getattr(module, attr, None)
            if current is not None and current in replace:
                setattr(module, attr, replace[current])


def _synchronize(handle: Any) -> Any:
    """Called once per tensor by Horovod's optimizer: without the device held there is nothing to hand back,
    and that costs a flag read (a reference kept past `uninstall` finds no phases)."""
    original = RUNTIME.original_waits["synchronize"]
    phases = RUNTIME.phases
    if phases is not None and phases.holding:
        with phases.waiting_for_peers():
            return _wait(handle, original)
    return _wait(handle, original)


def _wait(handle: Any, original: Callable[[Any], Any]) -> Any:
    if isinstance(handle, StagedHandle):
        return handle.stager.synchronize(handle, original)
    return original(handle)


def _staging(tensors: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this allreduce goes through the rank's stager: it has one, the device is shared, the tensors
    are on a GPU, and the call may be staged (`host_staging.stages`)."""
    if RUNTIME.stager is None or RUNTIME.session is None or not RUNTIME.session.shares_device:
        return False
    return all(getattr(t, "is_cuda", False) for t in tensors) and stages(args, kwargs)


def _allreduce_async_(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    if RUNTIME.stager is not None and _staging((tensor,), args, kwargs):  # once per tensor: a flag read first
        return RUNTIME.stager.allreduce_async_(tensor, *args, **kwargs)  # type: ignore[union-attr]
    return RUNTIME.original_waits["allreduce_async_"](tensor, *args, **kwargs)


def _grouped_allreduce_async_(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    if RUNTIME.stager is not None and tensors and _staging(tensors, args, kwargs):
        return RUNTIME.stager.grouped_allreduce_async_(tensors, *args, **kwargs)  # type: ignore[union-attr]
    return RUNTIME.original_waits["grouped_allreduce_async_"](tensors, *args, **kwargs)


def _poll(handle: Any) -> bool:
    if isinstance(handle, StagedHandle):
        done = handle.stager.poll(handle, RUNTIME.original_waits["poll"])
    else:
        done = bool(RUNTIME.original_waits["poll"](handle))
    phases = RUNTIME.phases
    if phases is not None:  # flag reads first: the quiet wait polls every tensor's handle
        if done:
            if phases.yielded:
                phases.resume()
        elif phases.holding:
            phases.pause()
    return done


def _shutdown(*args: Any, **kwargs: Any) -> Any:
    phases = RUNTIME.phases
    if phases is not None:
        phases.pause()
    return RUNTIME.original_waits["shutdown"](*args, **kwargs)


def _init(*args: Any, **kwargs: Any) -> Any:
    if RUNTIME.stager is not None:  # the new session must not get the old one's tensors
        RUNTIME.stager.close("Horovod was initialised again before this allreduce was handed over")
    result = RUNTIME.original_waits["init"](*args, **kwargs)
    on_init = RUNTIME.on_init
    if on_init is not None:
        try:
            on_init()
        except Exception:  # never break training
            _log.exception("crossover could not follow Horovod's re-init")
    return result


_WRAPPERS: dict[str, Callable[..., Any]] = {"synchronize": _synchronize, "poll": _poll, "shutdown": _shutdown,
                                            "init": _init, "allreduce_async_": _allreduce_async_,
                                            "grouped_allreduce_async_": _grouped_allreduce_async_}
