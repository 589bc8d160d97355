"""Hand the device back whenever a DDP rank waits for other ranks in `torch.distributed`.

DDP's own allreduces run inside the backward (`ddp_torch`); everything else a script
calls waits here: a metric's `all_reduce`, `barrier` before a checkpoint,
`broadcast_object_list`, `all_gather`, `ZeroRedundancyOptimizer`'s broadcasts. A holder
yields its device for the wait's length and asks again with the same iteration, as
Horovod's waits do (`horovod_waits`).

Only waits that block the host are bracketed: any collective on CPU tensors or a Gloo
group, a `barrier`, and the object collectives (they move pickles through the host).
An NCCL collective on CUDA tensors only orders the GPU's streams; the host goes on, and
yielding there would hand over a GPU that the collective's kernels still occupy.
``async_op=True`` returns at once; its ``Work.wait()`` is the wait: there the device is
handed back until the rank's next phase point (its next forward or optimizer step),
because a script waits for several handles in a row and one grant round trip each would
cost more than the waits. Inside `torch.compile`'s tracing nothing is bracketed.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

from crossover.plugins.hook.runtime import RUNTIME

__all__ = ["blocks_host", "install", "uninstall"]

_log = logging.getLogger(__name__)

_TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single")
_HOST_COLLECTIVES = ("barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object",
                     "scatter_object_list")

_originals: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Wrap the collectives in `torch.distributed` and its `distributed_c10d` (both names); idempotent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _originals or not dist.is_available():
        return
    for name in (*_TENSOR_COLLECTIVES, *_HOST_COLLECTIVES):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        _originals[name] = original
        wrapper = _bracket(original, host=name in _HOST_COLLECTIVES)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    work = dist.distributed_c10d.Work
    _originals["Work.wait"] = work.wait
    setattr(work, "wait", _work_wait(work.wait))  # noqa: B010 - a method of torch's C++ class


def uninstall() -> None:
    """Put `torch.distributed`'s functions back (tests use it)."""
    if not _originals:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setattr(dist.distributed_c10d.Work, "wait", _originals.pop("Work.wait"))  # noqa: B010
    for name, original in _originals.items():
        wrapper = getattr(c10d, name)
        setattr(c10d, name, original)
        if getattr(dist, name, None) is wrapper:
            setattr(dist, name, original)
    _originals.clear()


def _bracket(original: Callable[..., Any], host: bool) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        phases = RUNTIME.phases
        if phases is None or not phases.holding:  # flag reads on the common path
            return original(*args, **kwargs)
        try:
            given = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # the call itself will say what is wrong
            return original(*args, **kwargs)
        if given.get("async_op") or _compiling():
            return original(*args, **kwargs)
        if not host and not blocks_host(_first_tensor(tuple(given.values())), given.get("group")):
            return original(*args, **kwargs)
        with phases.waiting_for_peers():
            return original(*args, **kwargs)

    return wrapper


def _work_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        phases = RUNTIME.phases
        if phases is not None and phases.holding and not _compiling() and _work_blocks_host():
            phases.pause()  # the host waits; resumed at the next phase point
        return original(self, *args, **kwargs)

    return wait


def _work_blocks_host() -> bool:
    """A handle's wait blocks the host unless the rank's default group reduces CUDA tensors with NCCL."""
    import torch.distributed as dist

    try:
        return "nccl" not in str(dist.get_backend())
    except Exception:
        return True


def blocks_host(tensor: Any, group: Any = None) -> bool:
    """Whether a collective on ``tensor`` (or a list whose first is it) in ``group`` makes the host wait: its
    tensors are on the CPU, or its group reduces CUDA tensors without NCCL."""
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    if tensor is None or not getattr(tensor, "is_cuda", False):
        return True
    import torch.distributed as dist

    try:
        return "nccl" not in str(dist.get_backend(group))
    except Exception:  # a group this rank is not in: the call itself will say so
        return True


def _first_tensor(values: tuple[Any, ...]) -> Any:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _compiling() -> bool:
    import torch

    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False
