"""The plugin Adasum's collectives over Horovod, in one process set."""
from __future__ import annotations

from typing import Any, Optional

import torch

from crossover.plugins.aggregation.selection import AggregationError

__all__ = ["HorovodCollectives"]


class HorovodCollectives:
    """:class:`~crossover.plugins.aggregation.adasum.algorithms.PairwiseCollectives` over Horovod, in one process set.

    ``allgather`` is one ``hvd.allgather`` of the tensor with a leading dim
    of 1; ``exchange`` is one ``hvd.alltoall`` whose splits are non-zero only
    towards ``send_to``. A rank that sends nothing still needs the dtype of
    the round: :meth:`expect` sets it (the plugin optimizer calls it for each
    fusion group). Every rank of the set must make the same calls in the same
    order; the op names count calls, so they match across ranks.
    """

    def __init__(self, hvd: Any, process_set: Any = None, *, name: str = "crossover.adasum") -> None:
        self._hvd = hvd
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._name = name
        self._calls = 0
        self._dtype = torch.float32
        self._device = torch.device("cpu")

    @property
    def process_set(self) -> Any:
        return self._process_set

    @property
    def rank(self) -> int:
        return int(self._process_set.rank())

    @property
    def size(self) -> int:
        return int(self._process_set.size())

    def expect(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        """Dtype (and device) of the next exchanges, for ranks that only receive or idle."""
        self._dtype = dtype
        self._device = device if device is not None else torch.device("cpu")

    def _next_name(self, kind: str) -> str:
        self._calls += 1
        return f"{self._name}.{kind}.{self._calls}"

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = self._hvd.allgather(
            tensor.reshape(1, -1).contiguous(), name=self._next_name("allgather"), process_set=self._process_set
        )
        return gathered.reshape(self.size, *tensor.shape)

    def exchange(
        self, tensor: Optional[torch.Tensor], send_to: Optional[int], recv_from: Optional[int]
    ) -> Optional[torch.Tensor]:
        size = self.size
        splits = torch.zeros(size, dtype=torch.int32)
        if tensor is not None and send_to is not None:
            data = tensor.reshape(-1).contiguous()
            splits[send_to] = data.numel()
        else:
            data = torch.empty(0, dtype=self._dtype, device=self._device)
        received, counts = self._hvd.alltoall(
            data, splits=splits, name=self._next_name("exchange"), process_set=self._process_set
        )
        if recv_from is None:
            return None
        counts = [int(c) for c in counts]
        if sum(counts) != counts[recv_from]:
            raise AggregationError(f"Adasum exchange: expected data only from rank {recv_from}, got splits {counts}")
        return received
