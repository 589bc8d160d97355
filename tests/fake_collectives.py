"""In-process stand-in for Horovod collectives: one thread per rank, meeting at a barrier.

Unit tests of the plugin's Adasum (the functions and the optimizer) run their
ranks through it instead of processes; the multi-process tier checks the same
code over real Horovod.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch


class FakeGroup:
    """Shared state of one fake group: a barrier, allgather slots, point-to-point mail, call counts."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[Optional[torch.Tensor]] = [None] * size
        self.mail: dict[tuple[int, int], torch.Tensor] = {}
        self.lock = threading.Lock()
        self.calls = {"allgather": 0, "exchange": 0}  # counted on rank 0


class FakeCollectives:
    """One rank's view of a ``FakeGroup``: ``PairwiseCollectives`` plus ``HorovodCollectives.expect``."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def expect(self, dtype: torch.dtype, device: Any = None) -> None:
        pass

    def _count(self, name: str) -> None:
        if self._rank == 0:
            self._group.calls[name] += 1

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count("allgather")
        group = self._group
        group.slots[self._rank] = tensor.clone()
        group.barrier.wait()
        gathered = torch.stack([slot for slot in group.slots if slot is not None])
        group.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered

    def exchange(
        self, tensor: Optional[torch.Tensor], send_to: Optional[int], recv_from: Optional[int]
    ) -> Optional[torch.Tensor]:
        self._count("exchange")
        group = self._group
        if send_to is not None:
            assert tensor is not None
            with group.lock:
                group.mail[(self._rank, send_to)] = tensor.clone()
        group.barrier.wait()
        received = None
        if recv_from is not None:
            with group.lock:
                received = group.mail.pop((recv_from, self._rank))
        group.barrier.wait()
        return received


def run_ranks(size: int, body: Callable[[FakeCollectives], Any]) -> tuple[list[Any], FakeGroup]:
    """Run ``body`` once per rank in its own thread; results in rank order, and the group (for its counts)."""
    group = FakeGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(FakeCollectives(group, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results, group
