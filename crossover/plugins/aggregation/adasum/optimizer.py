"""The plugin's Adasum optimizer: delta-based Adasum over Horovod collectives, as Horovod's own does it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from crossover.plugins.aggregation.adasum.algorithms import AdasumAlgorithm, adasum_allreduce_tensors
from crossover.plugins.aggregation.adasum.collectives import HorovodCollectives
from crossover.plugins.aggregation.selection import AggregationError
from crossover.plugins.hook.composed_optimizer import ComposedOptimizer

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer(ComposedOptimizer):
    """Delta-based Adasum over :class:`HorovodCollectives` (the plugin path).

    Wraps the user's optimizer by composition: it shares the wrapped
    optimizer's ``param_groups`` list and ``state``, so learning-rate
    schedulers, ``state_dict()`` and checkpoints see one optimizer. Each
    ``step()``: apply the wrapped optimizer locally, take the deltas, and
    :meth:`synchronize` Adasum-combines them (one fused collective per dtype)
    and sets ``p = p_before + combined``, as Horovod's
    ``_DistributedAdasumOptimizer`` does. Gradients accumulate over
    ``backward_passes_per_step`` passes as usual, since the reduction only
    happens in ``step()``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        collectives: HorovodCollectives,
        *,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        algorithm: AdasumAlgorithm = "allgather",
    ) -> None:
        if backward_passes_per_step < 1:
            raise AggregationError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        super().__init__(optimizer)
        self._collectives = collectives
        self._compression = compression
        self._algorithm = algorithm
        self.backward_passes_per_step = backward_passes_per_step
        self._pending: Optional[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = None

    @property
    def algorithm(self) -> AdasumAlgorithm:
        return self._algorithm

    def __repr__(self) -> str:
        return f"AdasumOptimizer({self._inner!r}, algorithm={self._algorithm})"

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            self._inner.step()
            deltas = [p.detach() - start for p, start in zip(params, starts)]
        self._pending = (params, starts, deltas)
        self.synchronize()
        return loss

    def synchronize(self) -> None:
        """Combine the pending deltas across ranks and apply them; a no-op when none are pending.

        Unlike Horovod's averaging optimizer there is nothing to wait for
        before ``step()``: the deltas only exist once the local step ran.
        """
        if self._pending is None:
            return
        params, starts, deltas = self._pending
        self._pending = None
        compression = self._compression
        if compression is not None:
            pairs = [compression.compress(delta) for delta in deltas]
            sent = [pair[0] for pair in pairs]
        else:
            pairs, sent = [], deltas
        reduced = self._reduce(sent)
        with torch.no_grad():
            for index, (param, start) in enumerate(zip(params, starts)):
                combined = reduced[index]
                if compression is not None:
                    combined = compression.decompress(combined, pairs[index][1])
                param.copy_(start + combined.to(start.dtype))

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, tensor in enumerate(tensors):
            groups.setdefault((tensor.dtype, tensor.device), []).append(index)
        out: list[Optional[torch.Tensor]] = [None] * len(tensors)
        # Same order on every rank: dicts keep insertion order and every rank
        # has the same parameters in the same order.
        for (dtype, device), indices in groups.items():
            self._collectives.expect(dtype, device)
            results = adasum_allreduce_tensors(
                [tensors[i] for i in indices], self._collectives, algorithm=self._algorithm
            )
            for index, result in zip(indices, results):
                out[index] = result
        return [tensor for tensor in out if tensor is not None]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AggregationError("skip_synchronize() is not supported with Adasum (Horovod's Adasum optimizer "
                               "does not support it either): call step() without synchronize()")
        yield  # pragma: no cover - unreachable, makes this a generator

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending is not None:
            raise AggregationError("zero_grad() between step()'s local update and synchronize() would lose the "
                                   "update; let step() finish first")
        self._inner.zero_grad(set_to_none=set_to_none)
