"""A rank's side of the memory caps: the daemon's cap, applied to the rank's allocator on its device.

The daemon decides what each job may hold of a device (`crossoverd --reserve`,
`crossover.daemon.policies.memory`) and tells each rank in `DeviceShare`; the
rank only applies it. The cap counts the rank's whole footprint on the device,
as NVML does: what lies outside its allocator (a CUDA context, NCCL's buffers)
is measured and the rest becomes the allocator's limit. A device whose
allocator can be capped is a `DeviceMemory`: the CUDA caching allocator
(`crossover.plugins.hook.cuda_memory`), or the test bed's emulated device.

Every device call is made on the training thread (`at_phase_point`, where the
rank is about to use its device: a forward, zero_grad, the update), never
mid-backward: the session's receiving thread only records the cap. When the
allocator refuses an allocation at the cap, the device calls `refused`, which
logs one line (what the cap was, why, which setting changes it), reports the
refusal to the daemon and returns the line for the error the rank raises. A
rank with no cap gets no observer and no measurement: nothing changes for it.
A cap stays while the daemon is away: lifting it could let the job take memory
a higher class has reserved.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from crossover.figures import format_bytes

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


RECHECK_EVERY = 200
"""Phase points between two measurements of a capped rank's footprint: what lies outside its allocator grows
after the cap is first applied (NCCL's buffers at the first collective), and the pool's limit follows it."""


class MemoryCaps:
    """The rank's cap as the daemon last said it, and its application to the rank's device.

    `report(asked)` tells the daemon of a refusal at the cap (`Session` sends MEMORY_CAP_HIT).
    """

    def __init__(self, job: str, report: Callable[[int], None]) -> None:
        self._job = job
        self._report = report
        self._lock = threading.Lock()
        self.limit: int | None = None  # the footprint the rank may hold on its device (None: no cap)
        self.why = ""
        self.device_index = -1
        self.pool_limit: int | None = None  # what was applied to the allocator (None: no limit)
        self._device: DeviceMemory | None = None
        self._watching = False  # the device reports refusals to `refused` (from the first cap on)
        self.pending = False  # a cap (or a device) arrived that the training thread has not applied yet
        self._since = 0  # phase points since the footprint was last measured
        self._failed = False
        self.refusals = 0

    @property
    def in_use(self) -> bool:
        """Whether a device's allocator was given (`use`)."""
        return self._device is not None

    def told(self, limit: int | None, why: str, device_index: int) -> None:
        """The daemon's word (on the receiving thread): applied at the next phase point."""
        with self._lock:
            if (limit, why) == (self.limit, self.why):
                return
            self.limit, self.why, self.device_index = limit, why, device_index
            self.pending = True

    def use(self, device: DeviceMemory) -> None:
        """The device whose allocator the caps apply to (once, before or after the first cap)."""
        with self._lock:
            self._device = device
            self.pending = True

    def at_phase_point(self) -> None:
        """The training thread is about to use the device (a forward, zero_grad, the update): apply a new cap,
        and measure a capped rank's footprint again now and then. Nothing here runs mid-backward."""
        if self.pending:
            self._apply()
        elif self.limit is not None and self._device is not None:
            self._since += 1
            if self._since >= RECHECK_EVERY:
                self._apply()

    def _apply(self) -> None:
        """Apply the latest cap to the device's allocator. Until the rank uses its device (no context yet) it
        stays pending. A rank that still holds more than its cap once its cached memory is given back fails
        here, with the line (`OverMemoryCap`): it would otherwise keep memory a higher class reserved. A
        device call that fails is logged once and the cap left as it was: it never stops training."""
        self._since = 0
        with self._lock:
            device, limit, why = self._device, self.limit, self.why
            if device is None:
                return
        try:
            held = device.footprint() if limit is not None else None
            if limit is not None and held is None:
                return  # not in use yet: applied once it is
            self.pending = False
            if limit is None:
                if self.pool_limit is not None:
                    device.set_limit(None)
                    self.pool_limit = None
                    _log.info("crossover: job %r: no memory cap on device %d any more", self._job,
                              self.device_index)
                return
            assert held is not None
            if not self._watching:
                self._watching = True
                device.on_refusal(self.refused)
            pool = max(0, limit - held.outside)
            if pool != self.pool_limit:
                device.set_limit(pool)
                self.pool_limit = pool
                _log.info("crossover: job %r may hold %s on device %d (%s outside its allocator, measured: the "
                          "allocator keeps below %s)", self._job, why.split(",")[0], self.device_index,
                          format_bytes(held.outside), format_bytes(pool))
            after = device.footprint() or held
        except Exception:  # a device call failed: keep training, with the cap as it was
            self.pending = False
            if not self._failed:
                self._failed = True
                _log.exception("crossover: could not apply the memory cap on device %d", self.device_index)
            return
        if after.pool > pool:
            raise device.refusal(self.refused(after.pool - pool))

    def line(self, asked: int = 0) -> str:
        """The out-of-memory line: what the cap was, why, and which setting changes it."""
        more = f" asking for {format_bytes(asked)} more" if asked else ""
        return (f"crossover: job {self._job!r} ran out of its memory cap on device {self.device_index}{more}: "
                f"it may hold {self.why}")

    def refused(self, asked: int) -> str:
        """The allocator refused an allocation at the cap (on the allocating thread; the device tells a full
        device apart and does not call this for one): one line, and a word to the daemon; returns the line
        ("" when the rank has no cap)."""
        if self.limit is None:
            return ""
        self.refusals += 1
        text = self.line(asked)
        _log.error("%s", text)
        try:
            self._report(asked)
        except Exception:  # the report is best effort: the error itself goes on to the script
            _log.debug("crossover: could not report the refusal to crossoverd", exc_info=True)
        return text
