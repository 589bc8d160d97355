"""Turns that end on a CUDA GPU: stream memory operations on the daemon's turn pages, through the driver.

`cuStreamWaitValue32` (greater or equal) and `cuStreamWriteValue32` on host
memory registered for the device are the two halves of a hand-over the GPU
performs itself: the next holder's stream waits for a word that the holder's
stream stores once its work is done (NCCL's host-mapped abort flag is the same
pattern). The driver is reached through ctypes (no extension to build); the
pages are mapped with libc's mmap so that a read-only page has an address too.
Everything runs on the context torch made current, on the stream a callback
names (torch's current stream), and `CudaUnavailable` says why not where it
cannot: no driver, a driver without the calls, a device that cannot register
the pages.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections import deque
from ctypes import byref, c_char_p, c_int, c_long, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from typing import Any, Callable

from crossover.errors import CrossoverError

__all__ = ["CudaTurns", "CudaUnavailable", "RunAhead", "StreamMemory"]

PAGE_BYTES = 4096
_WAIT_GEQ = 0x0
_REGISTER_PORTABLE, _REGISTER_DEVICEMAP, _REGISTER_READ_ONLY = 0x01, 0x02, 0x08
_MAP_FAILED = ctypes.c_void_p(-1).value


class CudaUnavailable(CrossoverError, RuntimeError):
    """A driver call failed or is missing; the message names the call and the driver's error."""


class StreamMemory:
    """libcuda's stream memory operations and host registration, on the current context."""

    def __init__(self) -> None:
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaUnavailable(f"no CUDA driver here: {exc}") from exc
        self._wait = self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._write = self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        for f in (self._wait, self._write):
            f.argtypes = [c_void_p, c_uint64, c_uint32, c_uint]
        self._register = self._fn("cuMemHostRegister_v2", "cuMemHostRegister")
        self._register.argtypes = [c_void_p, c_size_t, c_uint]
        self._device_ptr = self._fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._device_ptr.argtypes = [ctypes.POINTER(c_uint64), c_void_p, c_uint]

    def _fn(self, *names: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        for name in names:
            f = getattr(self._cu, name, None)
            if f is not None:
                f.restype = c_int
                return f
        raise CudaUnavailable(f"the CUDA driver has none of {', '.join(names)}")

    def check(self, rc: int, what: str) -> None:
        if rc:
            name = c_char_p()
            self._cu.cuGetErrorName(rc, byref(name))
            raise CudaUnavailable(f"{what}: {(name.value or b'?').decode()} ({rc})")

    def register_host(self, host_addr: int, size: int, read_only: bool = False) -> int:
        """Pin and map `size` bytes of host memory at `host_addr` for the device; their device address."""
        flags = _REGISTER_PORTABLE | _REGISTER_DEVICEMAP | (_REGISTER_READ_ONLY if read_only else 0)
        self.check(self._register(c_void_p(host_addr), size, flags), "cuMemHostRegister")
        dev = c_uint64()
        self.check(self._device_ptr(byref(dev), c_void_p(host_addr), 0), "cuMemHostGetDevicePointer")
        return dev.value

    def wait_value(self, stream: int, device_addr: int, value: int) -> None:
        """The stream waits, on the GPU, until the 32-bit word at `device_addr` is ≥ `value`."""
        self.check(self._wait(c_void_p(stream), device_addr, value, _WAIT_GEQ), "cuStreamWaitValue32")

    def write_value(self, stream: int, device_addr: int, value: int) -> None:
        """The stream stores `value` at `device_addr` once its earlier work is done."""
        self.check(self._write(c_void_p(stream), device_addr, value, 0), "cuStreamWriteValue32")


def _map_page(fd: int, writable: bool) -> int:
    """Map a turn page shared (read-only unless `writable`); its address. Mappings live as long as the process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = c_void_p
    libc.mmap.argtypes = [c_void_p, c_size_t, c_int, c_int, c_int, c_long]
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = libc.mmap(None, PAGE_BYTES, prot, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a turn page: {os.strerror(err)}")
    return int(addr)


class CudaTurns:
    """`crossover.client.rank.device_turns.DeviceTurns` on a CUDA GPU: every call is one driver call on `stream()`."""

    name = "CUDA stream memory operations"

    def __init__(self, stream: Callable[[], int], drain: Callable[[], None],
                 memory: StreamMemory | None = None) -> None:
        self._memory = memory or StreamMemory()
        self._stream = stream
        self._drain = drain
        self._own = 0
        self._peers: dict[int, int] = {}  # page id -> its device address

    def attach_own(self, fd: int) -> None:
        self._own = self._memory.register_host(_map_page(fd, writable=True), PAGE_BYTES)

    def attach_peer(self, page: int, fd: int) -> None:
        self._peers[page] = self._memory.register_host(_map_page(fd, writable=False), PAGE_BYTES, read_only=True)

    def wait(self, page: int, ticket: int) -> None:
        self._memory.wait_value(self._stream(), self._peers[page], ticket)

    def signal(self, ticket: int) -> None:
        self._memory.write_value(self._stream(), self._own, ticket)

    def drain(self) -> None:
        self._drain()


def wait_for_device() -> None:
    """Block until torch's current CUDA stream has done its queued work, sleeping rather than spinning."""
    import torch

    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()


def torch_cuda_turns() -> CudaTurns:
    """`CudaTurns` on torch's current CUDA stream; CudaUnavailable where the driver cannot."""
    import torch

    def stream() -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    return CudaTurns(stream, wait_for_device)


class RunAhead:
    """How far a rank's CPU may run ahead of its GPU: each call marks the work queued so far and returns
    once at most `depth` marks are still unfinished.

    An outranked rank calls it at every layer boundary (`PhaseReporter.at_boundary`), so when it yields,
    at most `depth` layers of its work stand between the higher-class rank and the GPU, not the rest of
    a forward and backward that its CPU queued long before. `mark` records a point in the queue and
    returns something with `synchronize()` (a CUDA event on torch's current stream by default).
    """

    def __init__(self, depth: int = 2, mark: Callable[[], Any] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth {depth}: at least one mark must stay queued")
        self.depth = depth
        self._mark = mark or _cuda_mark
        self._marks: deque[Any] = deque()

    def __call__(self) -> None:
        self._marks.append(self._mark())
        while len(self._marks) > self.depth:
            self._marks.popleft().synchronize()


def _cuda_mark() -> Any:
    import torch

    mark = torch.cuda.Event(blocking=True)  # its wait sleeps: the CPU stays free for the other jobs' ranks
    mark.record()
    return mark
