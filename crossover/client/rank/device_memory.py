"""A rank's side of the memory caps: the daemon's cap, applied to the rank's allocator on its device.

The daemon decides what each job may hold of a device (`crossoverd --reserve`,
`crossover.daemon.policies.memory`) and tells each rank in `DeviceShare`; the
rank only applies it. The cap counts the rank's whole footprint on the device,
as NVML does: what lies outside its allocator (a CUDA context, NCCL's buffers)
is measured and the rest becomes the allocator's limit. A device whose
allocator can be capped is a `DeviceMemory`: the CUDA caching allocator
(`crossover.plugins.hook.cuda_memory`), or the test bed's emulated device.

Every device call is made on the training thread (`apply_pending`, at a
phase point): the session's receiving thread only records the cap. When the
allocator refuses an allocation, the device calls `refused`, which logs one
line (what the cap was, why, which setting changes it), reports the refusal
to the daemon and returns the line for the error the rank raises.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["DeviceMemory", "Footprint", "MemoryCaps", "OverMemoryCap"]

_log = logging.getLogger(__name__)


class OverMemoryCap(Exception):
    """A rank holds more of its device than its cap allows: the one error the plugin raises into training.

    The device's `refusal` makes it a subclass of the allocator's own out-of-memory error too, so a script
    that catches that (to retry with a smaller batch) catches this.
    """


@dataclass(frozen=True)
class Footprint:
    """What the rank holds on its device: in its allocator's pool, and outside it (context, NCCL, driver)."""

    pool: int
    outside: int


@runtime_checkable
class DeviceMemory(Protocol):
    """A device whose allocator the rank can cap; every call is made on the training thread."""

    name: str

    def footprint(self) -> Footprint | None:
        """What the rank holds there now, measured; None while the device is not in use yet (no context)."""

    def set_limit(self, pool_bytes: int | None) -> None:
        """Let the allocator's pool grow to `pool_bytes` at most (None: no limit), and give back cached
        memory above it."""

    def on_refusal(self, callback: Callable[[int], str]) -> None:
        """Call `callback(asked_bytes)` (0: not known) when the allocator refuses an allocation; it returns
        the line to add to the error."""

    def refusal(self, line: str) -> OverMemoryCap:
        """The error to raise when the rank holds more than its cap: an `OverMemoryCap` that is also the
        allocator's own out-of-memory error, carrying `line`."""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class MemoryCaps:
    """The rank's cap as the daemon last said it, and its application to the rank's device.

    `report(asked)` tells the daemon of a refusal at the cap (`Session` sends MEMORY_CAP_HIT).
    """

    def __init__(self, job: str, report: Callable[[int], None]) -> None:
        self._job = job
        self._report = report
        self._lock = threading.Lock()
        self.limit = 0  # the footprint the rank may hold on its device (0: no cap)
        self.why = ""
        self.device_index = -1
        self.pool_limit: int | None = None  # what was applied to the allocator (None: no limit)
        self._device: DeviceMemory | None = None
        self.pending = False  # a cap (or a device) arrived that the training thread has not applied yet
        self.refusals = 0

    def told(self, limit: int, why: str, device_index: int) -> None:
        """The daemon's word (on the receiving thread): applied at the next `apply_pending`."""
        with self._lock:
            if (limit, why) == (self.limit, self.why):
                return
            self.limit, self.why, self.device_index = limit, why, device_index
            self.pending = True

    @property
    def in_use(self) -> bool:
        """Whether a device's allocator was given (`use`)."""
        return self._device is not None

    def use(self, device: DeviceMemory) -> None:
        """The device whose allocator the caps apply to (once, before or after the first cap)."""
        with self._lock:
            self._device = device
            self.pending = True
        device.on_refusal(self.refused)

    def apply_pending(self) -> None:
        """Apply the latest cap to the device's allocator (the training thread, at a phase point). Until the
        rank uses its device (no context yet) it stays pending. A rank that still holds more than its new
        cap once its cached memory is given back fails here, with the line (`OverMemoryCap`): it would
        otherwise keep memory a higher class has reserved."""
        with self._lock:
            device, limit, why = self._device, self.limit, self.why
            if device is None or not self.pending:
                return
            held = device.footprint() if limit else None
            if limit and held is None:
                return  # not in use yet: applied once it is
            self.pending = False
        if not limit:
            if self.pool_limit is not None:
                device.set_limit(None)
                self.pool_limit = None
                _log.info("crossover: job %r: no memory cap on device %d any more", self._job, self.device_index)
            return
        assert held is not None
        pool = max(0, limit - held.outside)
        device.set_limit(pool)
        self.pool_limit = pool
        _log.info("crossover: job %r may hold %s on device %d (%s outside its allocator, measured: the "
                  "allocator keeps below %s)", self._job, why.split(",")[0], self.device_index, _gib(held.outside),
                  _gib(pool))
        after = device.footprint() or held
        if after.pool > pool:
            raise device.refusal(self.refused(after.pool - pool))

    def line(self, asked: int = 0) -> str:
        """The out-of-memory line: what the cap was, why, and which setting changes it."""
        more = f" asking for {_gib(asked)} more" if asked else ""
        return (f"crossover: job {self._job!r} ran out of its memory cap on device {self.device_index}{more}: "
                f"it may hold {self.why}")

    def refused(self, asked: int) -> str:
        """The allocator refused an allocation (on the allocating thread): one line, and a word to the
        daemon; returns the line ("" when the rank has no cap: the device itself was full)."""
        if not self.limit:
            return ""
        self.refusals += 1
        text = self.line(asked)
        _log.error("%s", text)
        try:
            self._report(asked)
        except Exception:  # the report is best effort: the error itself goes on to the script
            _log.debug("crossover: could not report the refusal to crossoverd", exc_info=True)
        return text
