"""A GPU rank's allreduce through host memory, copied back in one batch: `CROSSOVER_HOST_STAGING`.

Horovod built without a GPU allreduce (Gloo on GPUs, no NCCL) reduces a CUDA
tensor on the CPU. It copies the tensor to host memory, runs the ring, and then
copies the result back on its background thread, one tensor at a time, waiting
for each copy before it goes on to the next response's ring. Each of those
waits needs the GPU. A rank alone on its GPU barely notices them, but a rank
whose allreduce another job's compute fills (the gaps the priority classes give
a low job) waits for the GPU at every copy, in the middle of its ring.
`bench.gpu --only gapcost` measures what one-by-one copies cost beside a
neighbour against the same copies queued at once.

With the setting on, while another rank shares the device, the plugin stages
a named allreduce itself. It copies the tensor to pinned host memory on its
device's current stream and records an event there. A thread of its own waits
for the event and then enqueues the host tensor into Horovod. The caller gets
a `StagedHandle`. At `synchronize` the plugin queues every copy back on the
caller's stream without waiting. The copies run once the ring is done, beside
whatever holds the GPU then, and only the rank's next kernels wait for them.
Horovod reduces the same host tensors with the same arguments, so the results
are the same.

Not staged, left to Horovod: unnamed allreduces (Horovod names them by a handle
number, which must be allocated in the same order on every rank), Adasum
(Horovod's CPU Adasum has rules of its own), and anything but CUDA tensors. A
build whose allreduce is CUDA-aware MPI (`HOROVOD_GPU_ALLREDUCE=MPI`) reduces on
the GPU, and Python cannot tell it from Gloo: leave the setting off there.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CudaStaging", "HostStager", "StagedHandle", "StagingStopped", "horovod_reduces_on_gpu", "stages"]


class CudaStaging:
    """The device side of staging: copy out and mark, wait for the mark, copy back; none of them waits
    except `wait`."""

    @staticmethod
    def to_host(tensor: Any) -> Any:
        """A pinned host copy, queued on the current stream of the tensor's device (torch pins the host side
        of a non-blocking copy out)."""
        return tensor.to("cpu", non_blocking=True)

    @staticmethod
    def mark(tensors: Sequence[Any]) -> Any:
        """An event after the copies out, on the current stream of each device they came from."""
        import torch

        events = []
        for device in dict.fromkeys(t.device for t in tensors):
            event = torch.cuda.Event(blocking=True)  # its wait sleeps instead of spinning a core
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    @staticmethod
    def wait(mark: Any) -> None:
        """Sleep until every event of `mark` has passed."""
        for event in mark:
            event.synchronize()

    @staticmethod
    def copy_back(tensor: Any, host: Any) -> None:
        """Queue the copy of the reduced host tensor into the device tensor on the caller's stream."""
        tensor.copy_(host, non_blocking=True)


@dataclass(eq=False)
class StagedHandle:
    """What `allreduce_async_` returns for a staged tensor; its stager's `poll` and `synchronize` take it."""

    stager: HostStager
    tensors: list[Any]
    hosts: list[Any]
    grouped: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mark: Any = None
    inner: Any = None  # Horovod's handle of the host tensors, once enqueued
    error: BaseException | None = None
    enqueued: threading.Event = field(default_factory=threading.Event)


class HostStager:
    """Stages CUDA tensors for Horovod's allreduce (`enqueue`, `enqueue_grouped`: Horovod's own functions)."""

    def __init__(self, enqueue: Callable[..., Any], enqueue_grouped: Callable[..., Any],
                 device: Any = CudaStaging) -> None:
        self._enqueue = enqueue
        self._enqueue_grouped = enqueue_grouped
        self._device = device
        self._queue: queue.SimpleQueue[StagedHandle | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def allreduce_async_(self, tensor: Any, *args: Any, **kwargs: Any) -> StagedHandle:
        return self._stage([tensor], False, args, kwargs)

    def grouped_allreduce_async_(self, tensors: Sequence[Any], *args: Any, **kwargs: Any) -> StagedHandle:
        return self._stage(list(tensors), True, args, kwargs)

    def _stage(self, tensors: list[Any], grouped: bool, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> StagedHandle:
        handle = StagedHandle(self, tensors, [self._device.to_host(t) for t in tensors], grouped, args, kwargs)
        handle.mark = self._device.mark(tensors)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="crossover-host-staging",
                                                daemon=True)
                self._thread.start()
            self._queue.put(handle)
        return handle

    def _run(self, todo: queue.SimpleQueue[StagedHandle | None]) -> None:
        while True:
            handle = todo.get()
            if handle is None:
                return
            try:
                self._device.wait(handle.mark)
                enqueue = self._enqueue_grouped if handle.grouped else self._enqueue
                handle.inner = enqueue(handle.hosts if handle.grouped else handle.hosts[0], *handle.args,
                                       **handle.kwargs)
            except BaseException as exc:  # noqa: BLE001 - the caller's synchronize raises it
                handle.error = exc
            finally:
                handle.enqueued.set()

    def poll(self, handle: StagedHandle, poll: Callable[[Any], bool]) -> bool:
        """Whether `synchronize` would return at once (Horovod's `poll` on the host tensors)."""
        if not handle.enqueued.is_set():
            return False
        return handle.error is not None or bool(poll(handle.inner))

    def synchronize(self, handle: StagedHandle, synchronize: Callable[[Any], Any]) -> Any:
        """Wait for the allreduce (Horovod's `synchronize`), queue the copies back, return the device tensor(s)."""
        handle.enqueued.wait()
        if handle.error is not None:
            raise handle.error
        synchronize(handle.inner)
        for tensor, host in zip(handle.tensors, handle.hosts):
            self._device.copy_back(tensor, host)
        return list(handle.tensors) if handle.grouped else handle.tensors[0]

    def close(self, reason: str = "host staging stopped") -> None:
        """Stop the thread; what it has not enqueued yet fails with `StagingStopped` (`reason`).

        At uninstall, and at a Horovod re-init (elastic), whose new session must not get the old one's
        tensors. A later tensor starts a new thread."""
        with self._lock:
            thread, self._thread = self._thread, None
            todo, self._queue = self._queue, queue.SimpleQueue()  # a later thread gets a queue of its own
            pending: list[StagedHandle] = []
            while True:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item)
            todo.put(None)
        for handle in pending:
            handle.error = StagingStopped(reason)
            handle.enqueued.set()
        if thread is not None:
            thread.join()


class StagingStopped(RuntimeError):
    """A staged allreduce was never handed to Horovod: staging stopped first (uninstall, Horovod re-init)."""


def stages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an allreduce with these arguments (after the tensor) may be staged: it is named, and not Adasum."""
    name = kwargs["name"] if "name" in kwargs else (args[1] if len(args) > 1 else None)
    op = kwargs["op"] if "op" in kwargs else (args[2] if len(args) > 2 else None)
    return bool(name) and (op is None or not _is_adasum(op))


def _is_adasum(op: Any) -> bool:
    try:
        from horovod.torch.mpi_ops import Adasum
    except ImportError:  # no Horovod: nothing is Adasum
        return False
    return bool(op == Adasum)


def horovod_reduces_on_gpu(mpi_ops: Any) -> bool:
    """Whether this Horovod build reduces CUDA tensors on the GPU (NCCL, DDL, ROCm), so staging has nothing to do."""
    for probe in ("nccl_built", "ddl_built", "rocm_built"):
        fn = getattr(mpi_ops, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # noqa: BLE001 - a probe Horovod cannot answer says nothing
            continue
    return False
