"""The emulated device's memory (`testbed.device_model.memory`): pools, contexts, caps and refusals."""
from __future__ import annotations

from testbed.device_model.memory import MemoryBudget, Refusal

MiB = 1 << 20


def test_pools_grow_to_their_need_and_a_context_counts_once_allocated() -> None:
    m = MemoryBudget(1000 * MiB, context_bytes=100 * MiB)
    assert m.footprint("a") is None and m.free() == 1000 * MiB
    assert m.grow("a", 300 * MiB) is None
    assert m.footprint("a") == (300 * MiB, 100 * MiB) and m.free() == 600 * MiB
    assert m.grow("a", 200 * MiB) is None and m.footprint("a") == (300 * MiB, 100 * MiB)  # never shrinks
    assert m.grow("b", 501 * MiB) == Refusal("device", 0, -1, 600 * MiB)  # with its context: 601 MiB
    assert m.grow("b", 500 * MiB) is None and m.free() == 0
    m.remove("a")
    assert m.free() == 400 * MiB


def test_a_cap_refuses_past_it_and_keeps_what_is_held() -> None:
    m = MemoryBudget(1000 * MiB)
    assert m.grow("a", 400 * MiB) is None
    m.set_limit("a", 300 * MiB)
    assert m.footprint("a") == (400 * MiB, 0)
    assert m.grow("a", 400 * MiB) == Refusal("cap", 400 * MiB, 300 * MiB, 600 * MiB)
    m.set_limit("a", None)
    assert m.grow("a", 500 * MiB) is None


def test_an_unmodelled_device_never_refuses() -> None:
    m = MemoryBudget(0)
    assert m.grow("a", 1 << 50) is None
