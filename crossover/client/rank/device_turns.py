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

from crossover.protos.turn_page import PAGE_BYTES, WORD, reached

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

    def page(self, page: int, own: bool, fd: int | None) -> None:
        """A page from the daemon (on the session's receiving thread): kept for the training thread, which
        makes every device call (a GPU's context is current there, not here). `fd` None: the descriptor
        that should have ridden on the page's frame did not come."""
        if fd is None:
            _log.warning("crossover: the daemon sent turn page %d without its descriptor", page)
            return
        with self._lock:
            self._fds.append(fd)
            if own and self._own is None:
                self._own = fd
            elif not own:
                self._peers[page] = fd

    def use(self, device: DeviceTurns) -> bool:
        """The rank's device can wait and store (on the training thread); True when the rank just became ready."""
        with self._lock:
            if self.device is not None:
                return False
            self.device = device
        return self.attach_pending()

    def attach_pending(self) -> bool:
        """On the training thread: map the own page on the device once both are there; True when the rank just
        became ready (the daemon is to be told)."""
        with self._lock:
            device, own = self.device, self._own
            if device is None or own is None or self.ready:
                return False
            fd = os.dup(own)  # `close` on the receiving thread may close the original meanwhile
        try:
            device.attach_own(fd)
        except Exception as exc:  # a device that cannot map it: the usual release stays
            _log.warning("crossover: %s cannot map this rank's turn page (%s); its CPU waits for the device "
                         "before each release", device.name, exc)
            return False
        finally:
            os.close(fd)
        with self._lock:
            self.ready = self._own is not None
        if self.ready:
            _log.info("crossover: turns end on the device (%s)", device.name)
        return self.ready

    def wait_after(self, page: int, ticket: int) -> None:
        """Order this turn's work after the previous holder's ticket: on the device where it can, else on this
        rank's CPU (which polls the page read-only, at most `cpu_wait_limit_s`): the order holds either way."""
        with self._lock:
            device = self.device
            fd = self._peers.get(page)
            if not page or fd is None:
                if page:
                    _log.warning("crossover: a grant names turn page %d, which the daemon never sent", page)
                return
            fd = os.dup(fd)
            first = page not in self._mapped
            on_device = self.ready and device is not None
            if on_device:
                self._mapped.add(page)
        try:
            if on_device and device is not None:
                try:
                    if first:
                        device.attach_peer(page, fd)
                    device.wait(page, ticket)
                    return
                except Exception as exc:
                    if first:
                        _log.warning("crossover: %s cannot wait on turn page %d (%s); this rank's CPU waits for "
                                     "it", device.name, page, exc)
            self._wait_here(fd, ticket)
        finally:
            os.close(fd)

    cpu_wait_limit_s = 30.0

    def _wait_here(self, fd: int, ticket: int, poll_s: float = 200e-6) -> None:
        deadline = time.monotonic() + self.cpu_wait_limit_s
        with mmap.mmap(fd, PAGE_BYTES, prot=mmap.PROT_READ) as page:
            while not reached(WORD.unpack_from(page, 0)[0], ticket):
                if time.monotonic() > deadline:
                    _log.warning("crossover: turn ticket %d never came (its holder and the daemon gone?); going "
                                 "on after %.0f s", ticket, self.cpu_wait_limit_s)
                    return
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
