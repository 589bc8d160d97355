"""The memory cap on a CUDA GPU: torch's caching allocator, limited to what the daemon lets the rank hold.

`CudaMemory` is the rank's `DeviceMemory` (`crossover.client.rank.device_memory`)
on a GPU. It measures the rank's footprint outside the allocator (its CUDA
context, NCCL's buffers, cuBLAS's and the driver's share) as NVML's count for
the process less the allocator's pool, caps the pool with torch's
per-process memory fraction, and gives cached memory above a lowered cap back
to the device. When the allocator refuses an allocation, torch's
out-of-memory observer tells the rank, and the `OutOfMemoryError` the
script sees carries the cap's line as a note.

Nothing here initializes CUDA: until torch has a context on the device, the
footprint is unknown and the cap waits.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from crossover.client.rank.device_memory import Footprint, OverMemoryCap

__all__ = ["CudaMemory", "cap_exceeded", "use_cuda_memory"]

_log = logging.getLogger(__name__)

_UNMEASURED_OUTSIDE = 1 << 30
"""What the footprint outside the allocator is taken to be where NVML cannot name this process (a container
without the host's pid namespace): a CUDA context with NCCL's buffers, rounded up; logged as not measured."""


class CudaMemory:
    """`DeviceMemory` on CUDA device `index` (torch's numbering), through torch and NVML."""

    name = "CUDA caching allocator"

    def __init__(self, index: int) -> None:
        self.index = index
        self._nvml: Any = None
        self._handle: Any = None
        self._warned = False
        self._line: Callable[[int], str] | None = None
        self._last_line = ""

    def footprint(self) -> Footprint | None:
        import torch

        if not torch.cuda.is_initialized():
            return None
        pool = int(torch.cuda.memory_reserved(self.index))
        process = self._process_memory()
        if process is None:
            if not self._warned:
                self._warned = True
                _log.warning("crossover: NVML cannot name this process's memory on GPU %d; its footprint outside "
                             "the allocator is taken as %.1f GiB, not measured", self.index,
                             _UNMEASURED_OUTSIDE / (1 << 30))
            return Footprint(pool, _UNMEASURED_OUTSIDE)
        return Footprint(pool, max(0, process - pool))

    def set_limit(self, pool_bytes: int | None) -> None:
        import torch

        total = int(torch.cuda.get_device_properties(self.index).total_memory)
        fraction = 1.0 if pool_bytes is None else min(1.0, max(0.0, pool_bytes / total))
        try:
            lowered = fraction < torch.cuda.get_per_process_memory_fraction(self.index)
            torch.cuda.set_per_process_memory_fraction(fraction, self.index)
        except RuntimeError as exc:  # an allocator of the script's own (CUDAPluggableAllocator) has no fraction
            _log.warning("crossover: the memory cap cannot be applied to this process's allocator (%s); it is "
                         "not capped", exc)
            return
        if lowered:
            with torch.cuda.device(self.index):
                torch.cuda.empty_cache()

    def on_refusal(self, callback: Callable[[int], str]) -> None:
        import torch

        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            _log.info("crossover: this torch has no out-of-memory observer; a refusal at the memory cap is not "
                      "reported to crossoverd")
            return
        self._line = callback

        def observed(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
            # The device had room for it: the cap refused it. Otherwise the device itself was full.
            if device == self.index and self._line is not None and device_free >= alloc:
                self._last_line = self._line(int(alloc))

        attach(observed)
        _note_on_uncaught_oom(lambda: self._last_line)

    def refusal(self, line: str) -> OverMemoryCap:
        return cap_exceeded(f"CUDA out of memory on device {self.index}: this process holds more than its cap\n"
                            f"{line}")

    def _process_memory(self) -> int | None:
        """NVML's count of this process's memory on the device; None where NVML cannot say."""
        import os

        try:
            if self._handle is None:
                self._handle = self._nvml_handle()
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # NVMLError, or no NVML at all
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
        if not mine or any(used is None for used in mine):  # None: MIG or vGPU, where NVML does not count it
            return None
        return sum(int(used) for used in mine)

    def _nvml_handle(self) -> Any:
        import pynvml
        import torch

        pynvml.nvmlInit()
        self._nvml = pynvml
        uuid = str(getattr(torch.cuda.get_device_properties(self.index), "uuid", ""))
        if uuid:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return pynvml.nvmlDeviceGetHandleByIndex(self.index)


_CAP_EXCEEDED: list[type] = []


def cap_exceeded(message: str) -> OverMemoryCap:
    """An `OverMemoryCap` that is torch's `OutOfMemoryError` too (what a script that retries on it catches)."""
    if not _CAP_EXCEEDED:
        import torch

        _CAP_EXCEEDED.append(type("MemoryCapExceeded", (torch.OutOfMemoryError, OverMemoryCap),
                                  {"__module__": __name__, "__doc__": "A rank holds more than its memory cap."}))
    error = _CAP_EXCEEDED[0](message)
    assert isinstance(error, OverMemoryCap)
    return error


def _note_on_uncaught_oom(line: Callable[[], str]) -> None:
    """An `OutOfMemoryError` that ends the script carries the cap's line as a note (once installed)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        import torch

        text = line()
        if (text and isinstance(exc, torch.OutOfMemoryError) and hasattr(exc, "add_note")
                and text not in getattr(exc, "__notes__", ())):
            exc.add_note(text)
        previous(kind, exc, tb)

    sys.excepthook = hook


def use_cuda_memory(session: Any, index: int) -> None:
    """Cap this rank's allocator on CUDA device `index` as the daemon says (once per session)."""
    memory = getattr(session, "memory", None)
    if memory is not None and not memory.in_use:
        memory.use(CudaMemory(index))
