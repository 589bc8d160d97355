"""`Handoff`: a group on one node hands the model over through shared memory and a datagram to each member,
with no collective; a group with a member elsewhere (or without shared memory) broadcasts the model. Ranks
are threads here, meeting through a stand-in for the Horovod calls the hand-over makes; real `horovodrun`
jobs check the same code in tests/multiprocess/test_group_async_training.py."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import pytest
import torch

from crossover.plugins.aggregation.group_async import handoff as handoff_module
from crossover.plugins.aggregation.group_async.handoff import Handoff
from crossover.plugins.aggregation.group_async.shared_buffers import shared_memory_usable


class _Threads:
    """Horovod's broadcast_object, broadcast_ and allreduce(op=Min) for ranks that are threads of one process."""

    Min = "min"

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size, timeout=10)
        self._slots: list[Any] = [None] * size
        self.local = threading.local()
        self.broadcast_bytes = 0

    def _meet(self, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        self._slots[self.local.rank] = value
        self._barrier.wait()
        out = combine(list(self._slots))
        self._barrier.wait()
        return out

    def broadcast_object(self, obj: Any, root_rank: int, process_set: Any = None, name: str = "") -> Any:
        return self._meet(obj, lambda values: values[root_rank])

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, process_set: Any = None, name: str = "") -> None:
        if self.local.rank == root_rank:
            self.broadcast_bytes += tensor.numel() * tensor.element_size()
        sent = self._meet(tensor.clone(), lambda values: values[root_rank])
        tensor.copy_(sent)

    def allreduce(self, tensor: torch.Tensor, op: Any = None, process_set: Any = None, name: str = "") -> torch.Tensor:
        assert op == self.Min
        return self._meet(tensor.clone(), lambda values: torch.stack(values).min(dim=0).values)


def _group(size: int, shared: bool, per_rank: Callable[[Handoff, int], Any],
           setup: Optional[Callable[[int], None]] = None) -> tuple[_Threads, list[Any]]:
    hvd = _Threads(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        hvd.local.rank = r
        try:
            if setup is not None:
                setup(r)
            results[r] = per_rank(Handoff(hvd, None, tuple(range(size)), r, 6, shared), r)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return hvd, results


def _hand_twice(h: Handoff, r: int) -> tuple[bool, list[Optional[list[float]]], list[bool]]:
    models, overs = [], []
    for model, over in ((torch.arange(6.0), False), (None, True)):
        got, flag = h.hand(model if r == 0 else None, over if r == 0 else False)
        models.append(None if got is None else got.tolist())
        overs.append(flag)
    return h.through_shared_memory, models, overs


@pytest.mark.skipif(not shared_memory_usable(), reason="no writable /dev/shm on this machine")
def test_a_group_on_one_node_gets_the_model_through_shared_memory_without_a_collective():
    hvd, results = _group(3, True, _hand_twice)
    for shared, models, overs in results:
        assert shared
        assert models == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], None] and overs == [False, True]
    assert hvd.broadcast_bytes == 0


def test_a_group_with_a_member_on_another_node_broadcasts_the_model(monkeypatch):
    real = handoff_module.node_identity
    elsewhere = threading.local()

    def identity() -> dict[str, Any]:
        return {"boot": "other", "netns": 0} if getattr(elsewhere, "yes", False) else real()

    def setup(r: int) -> None:
        elsewhere.yes = r == 2

    monkeypatch.setattr(handoff_module, "node_identity", identity)
    hvd, results = _group(3, True, _hand_twice, setup)
    for shared, models, overs in results:
        assert not shared
        assert models == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], None] and overs == [False, True]
    assert hvd.broadcast_bytes == 2 * 8 * 4  # the model and two flags, twice


def test_without_shared_memory_the_model_is_broadcast():
    hvd, results = _group(2, False, _hand_twice)
    assert all(not shared for shared, _, _ in results)
    assert hvd.broadcast_bytes == 2 * 8 * 4


def test_a_member_whose_leader_is_gone_stops_waiting_with_a_clear_error(monkeypatch):
    import socket
    import subprocess
    import sys

    from crossover.plugins.aggregation.selection import AggregationError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(handoff_module, "POLL_S", 0.05)
    member = Handoff(_Threads(1), None, (0, 1), 1, 6, shared_memory=False)
    member.shared = torch.zeros(6)
    member._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    member._leader_pid = gone.pid
    with pytest.raises(AggregationError, match=f"leader \\(rank 0, pid {gone.pid}\\) is gone"):
        member.hand(None, False)
    member.close()


def test_a_member_takes_only_the_leaders_note():
    import socket

    member = Handoff(_Threads(1), None, (0, 1), 1, 6, shared_memory=False)
    member.shared = torch.zeros(6)
    member._tag = "t"
    member._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    member._sock.bind(handoff_module._address("t", 1))
    leader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    leader.bind(handoff_module._address("t", 0))
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stranger.sendto(handoff_module._FLAGS.pack(1, True, True), handoff_module._address("t", 1))  # right size
    stranger.sendto(b"x", handoff_module._address("t", 1))
    leader.sendto(handoff_module._FLAGS.pack(1, False, True), handoff_module._address("t", 1))
    assert member.hand(None, False) == (None, True)
    for s in (leader, stranger):
        s.close()
    member.close()
