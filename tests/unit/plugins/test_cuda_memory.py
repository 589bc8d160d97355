"""The CUDA side of the memory cap (`cuda_memory.CudaMemory`) with torch's CUDA calls faked: no GPU here. What it
must get right: never initialize CUDA itself, measure what lies outside the allocator, turn a pool limit into
torch's per-process fraction, give cache back only when the limit drops, and note the cap's line on an uncaught
out-of-memory error. The GPU run (`bench.gpu --only memory`) checks it against a real allocator."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from crossover.client.rank.device_memory import Footprint, OverMemoryCap
from crossover.plugins.hook import cuda_memory
from crossover.plugins.hook.cuda_memory import CudaMemory, cap_exceeded

GiB = 1 << 30


@pytest.fixture
def fake_cuda(monkeypatch):
    state = types.SimpleNamespace(initialized=False, reserved=2 * GiB, fraction=1.0, emptied=0, calls=[])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state.initialized)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: state.reserved)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(total_memory=80 * GiB, uuid=""))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: state.fraction)

    def set_fraction(fraction: float, index: int) -> None:
        state.calls.append((fraction, index))
        state.fraction = fraction

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(state, "emptied", state.emptied + 1))
    class _Device:
        def __init__(self, index: int) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(torch.cuda, "device", _Device)
    return state


def test_no_context_no_footprint_and_nothing_initialized(fake_cuda) -> None:
    assert CudaMemory(1).footprint() is None


def test_the_footprint_outside_the_allocator_is_nvml_less_the_pool(fake_cuda, monkeypatch) -> None:
    fake_cuda.initialized = True
    memory = CudaMemory(1)
    monkeypatch.setattr(memory, "_process_memory", lambda: 2 * GiB + (700 << 20))
    assert memory.footprint() == Footprint(2 * GiB, 700 << 20)
    monkeypatch.setattr(memory, "_process_memory", lambda: None)  # NVML cannot name the process: said, not hidden
    assert memory.footprint() == Footprint(2 * GiB, cuda_memory._UNMEASURED_OUTSIDE)


def test_a_limit_is_a_fraction_and_only_a_lower_one_empties_the_cache(fake_cuda) -> None:
    memory = CudaMemory(1)
    memory.set_limit(20 * GiB)
    memory.set_limit(30 * GiB)
    memory.set_limit(None)
    assert fake_cuda.calls == [(0.25, 1), (0.375, 1), (1.0, 1)] and fake_cuda.emptied == 1


def test_the_observer_blames_the_cap_only_where_the_device_had_room(fake_cuda, monkeypatch) -> None:
    observers = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: None)
    told = []
    memory = CudaMemory(1)
    memory.on_refusal(lambda asked: told.append(asked) or f"line {asked}")
    (observe,) = observers
    observe(1, GiB, 79 * GiB, 10 * GiB)  # (device, alloc, allowed or total, device free): room, the cap refused
    observe(1, GiB, 79 * GiB, GiB // 2)  # the device itself was full
    observe(0, GiB, 79 * GiB, 10 * GiB)  # another device
    assert told == [GiB]


def test_cap_exceeded_is_both_errors_and_an_uncaught_oom_carries_the_line(fake_cuda, monkeypatch) -> None:
    err = cap_exceeded("the line")
    assert isinstance(err, OverMemoryCap) and isinstance(err, torch.OutOfMemoryError) and str(err) == "the line"
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen.append(exc))
    cuda_memory._note_on_uncaught_oom(lambda: "crossover: job 'b' ran out of its memory cap")
    oom = torch.OutOfMemoryError("CUDA out of memory")
    sys.excepthook(type(oom), oom, None)
    other = ValueError("x")
    sys.excepthook(type(other), other, None)
    assert seen == [oom, other] and oom.__notes__ == ["crossover: job 'b' ran out of its memory cap"]
    assert not hasattr(other, "__notes__")
