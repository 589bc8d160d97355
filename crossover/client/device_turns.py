"""A rank's side of the hand-over on the device: its turn page, the pages it waits on, its tickets.

The daemon gives a rank that can take one a page of its own (a sealed memfd,
over the session socket). Once the rank's device can wait on pages and store
into them (`DeviceTurns`: CUDA stream memory operations, or the test bed's
emulated device), the rank says so; while every rank on its device does,
it ends each turn by queueing "store ticket N in my page" behind the turn's
work and releases at once, and a rank granted after it queues "wait until
that page reaches N" before its own work. Neither CPU waits for the device
and the daemon's round trip overlaps the previous turn's last work
(docs/handover.md). Without a device that can, nothing changes: the rank's
CPU waits for its device before each release, as before.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Protocol

__all__ = ["DeviceTurns", "TurnHandover"]

_log = logging.getLogger(__name__)


class DeviceTurns(Protocol):
    """What a device must do for the hand-over on it; every call but `drain` returns at once."""

    name: str

    def attach_own(self, fd: int) -> None:
        """Map this rank's own page (read-write) where the device can store into it, before returning: the
        daemon seals the page against new writable mappings once the rank says it is ready."""

    def attach_peer(self, page: int, fd: int) -> None:
        """Map page `page` of another rank (read-only) where the device can read it."""

    def wait(self, page: int, ticket: int) -> None:
        """Work queued after this starts only once page `page`'s word is at least `ticket`."""

    def signal(self, ticket: int) -> None:
        """Once the work queued so far is done, the device stores `ticket` in the own page."""

    def drain(self) -> None:
        """Block until the work queued so far is done (the usual release)."""


class TurnHandover:
    """The pages a rank was given, the device that uses them, and the tickets it ends its turns with.

    Pages arrive on the session's receiving thread and the device from the
    plugin, in either order: the rank is `ready` once both are there. File
    descriptors are this object's until `close`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.device: DeviceTurns | None = None
        self._own: int | None = None
        self._peers: dict[int, int] = {}  # page id -> descriptor, not yet given to the device
        self._mapped: set[int] = set()  # page ids the device has mapped
        self._fds: list[int] = []
        self.ready = False
        self._ticket = 0

    def page(self, page: int, own: bool, fd: int) -> bool:
        """A page from the daemon; True when the rank just became ready (the daemon is to be told)."""
        with self._lock:
            self._fds.append(fd)
            if own:
                if self._own is not None:
                    return False
                self._own = fd
                return self._attach_locked()
            self._peers[page] = fd
            return False

    def use(self, device: DeviceTurns) -> bool:
        """The rank's device can wait and store; True when the rank just became ready."""
        with self._lock:
            if self.device is not None:
                return False
            self.device = device
            return self._attach_locked()

    def _attach_locked(self) -> bool:
        if self.device is None or self._own is None or self.ready:
            return False
        try:
            self.device.attach_own(self._own)
        except Exception as exc:  # a device that cannot map it: the usual release stays
            _log.warning("crossover: %s cannot map this rank's turn page (%s); its CPU waits for the device "
                         "before each release", self.device.name, exc)
            return False
        self.ready = True
        _log.info("crossover: turns end on the device (%s)", self.device.name)
        return True

    def wait_after(self, page: int, ticket: int) -> None:
        """Queue the wait for the previous holder's ticket before this turn's work. Where the device cannot
        wait on that page, this rank's CPU waits for it instead: the order holds either way."""
        with self._lock:
            device = self.device
            if not self.ready or device is None or not page:
                return
            fd = self._peers.get(page)
            if fd is None:
                _log.warning("crossover: a grant names turn page %d, which the daemon never sent", page)
                return
            first = page not in self._mapped
            self._mapped.add(page)
        try:
            if first:
                device.attach_peer(page, fd)
            device.wait(page, ticket)
        except Exception as exc:
            if first:
                _log.warning("crossover: %s cannot wait on turn page %d (%s); this rank's CPU waits for it",
                             device.name, page, exc)
            self._wait_here(fd, ticket)

    @staticmethod
    def _wait_here(fd: int, ticket: int, poll_s: float = 200e-6) -> None:
        with mmap.mmap(fd, 4, prot=mmap.PROT_READ) as word:
            while int.from_bytes(word[:4], "little") < ticket:
                time.sleep(poll_s)

    def end_turn(self) -> int:
        """Queue this turn's ticket behind its work; the ticket, for the release (0: the device cannot,
        and the rank goes back to waiting for its device on its CPU)."""
        with self._lock:
            device = self.device
            if device is None or not self.ready:
                return 0
            self._ticket += 1
            ticket = self._ticket
        try:
            device.signal(ticket)
        except Exception as exc:
            _log.warning("crossover: %s cannot end a turn (%s); this rank's CPU waits for its device from now on",
                         device.name, exc)
            self.ready = False
            return 0
        return ticket

    def close(self) -> None:
        """The session ended: its pages go (the device keeps its mappings until it maps new ones)."""
        with self._lock:
            fds, self._fds = self._fds, []
            self._own, self._peers, self.ready, self._ticket = None, {}, False, 0
            self._mapped.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
