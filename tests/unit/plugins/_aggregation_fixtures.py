"""Shared by the aggregation tests: a clean selection per test, a fake Horovod and its optimizer factory."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from crossover.plugins.aggregation import set_aggregation, use_settings
from crossover.plugins.aggregation.process_state import STATE


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("CROSSOVER_AGGREGATION", "CROSSOVER_ADASUM_IMPL", "CROSSOVER_ADASUM_ALGORITHM",
                 "CROSSOVER_LBBSP_PERIOD", "CROSSOVER_LBBSP_MAX_BATCH", "CROSSOVER_LBBSP_METHOD"):
        monkeypatch.delenv(name, raising=False)
    set_aggregation(None)
    use_settings(None)
    STATE.lbbsp.state = None
    yield
    set_aggregation(None)
    use_settings(None)
    STATE.lbbsp.state = None


class FakeProcessSet:
    def __init__(self, rank: int, size: int, set_id: int = 0, member: bool = True) -> None:
        self._rank, self._size, self.process_set_id, self._member = rank, size, set_id, member

    def included(self) -> bool:
        return self._member

    def rank(self) -> int:
        if not self._member:
            raise ValueError("Process is not part of provided process set.")
        return self._rank

    def size(self) -> int:
        return self._size


class FakeHvd:
    """Enough of `horovod.torch` for the selection logic: one rank unless told otherwise."""

    Average, Sum, Adasum = "avg", "sum", "adasum"

    def __init__(self, size: int = 1, mpi: bool = False) -> None:
        self._size = size
        self._mpi = mpi
        self.global_process_set = FakeProcessSet(0, size)
        self.calls: list[tuple[str, Any]] = []

    def size(self) -> int:
        return self._size

    def local_size(self) -> int:
        return self._size

    def mpi_enabled(self) -> bool:
        return self._mpi

    def nccl_built(self) -> int:
        return 0

    def is_homogeneous(self) -> bool:
        return True

    def allgather_async(self, tensor: torch.Tensor, name: str, process_set: Any) -> Any:
        self.calls.append(("allgather_async", name))
        return tensor.clone()

    def synchronize(self, handle: Any) -> Any:
        return handle


def fake_factory(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1, op="avg",
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=None):
    """Stands for Horovod's DistributedOptimizer: records what it was given, adds `synchronize`."""
    optimizer.given = dict(op=op, gradient_predivide_factor=gradient_predivide_factor,
                           backward_passes_per_step=backward_passes_per_step, process_set=process_set)
    optimizer.synchronize = lambda: None
    return optimizer


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
