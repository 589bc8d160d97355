"""The hand-over on the device: one shared page per rank, whose word its device sets when a turn's work is done.

A rank that hands over on its device releases its turn as soon as the turn's
work is queued, not once the device has finished it: its device stores the
turn's ticket in the rank's own page after that work, and the next holder's
device waits for the page to reach the ticket before it starts the next
holder's work. The CPUs and this daemon leave the critical path: the grant's
round trip overlaps the holder's last kernels (docs/handover.md).

Each page is a 4096-byte memfd created here, sealed against resizing. Its
rank gets it writable and maps it; once the rank says so (`seal`), the page
is sealed against every new writable mapping and write, and only then does a
rank granted after it get a descriptor (read-only, and reopening it through
/proc cannot make it writable), so a rank writes only its own word. A wrong
value there moves only its successor's start, as overstaying a turn would. The daemon keeps its own writable
mapping and stores the ticket itself when a rank's session ends, or its
device has not stored it long after the release, so no dead or stuck holder
strands the rank after it. No CUDA here: the daemon stays a plain process.
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
from dataclasses import dataclass, field

from crossover.errors import CrossoverError
from crossover.protos.turn_page import PAGE_BYTES, WORD, reached

__all__ = ["PAGE_BYTES", "Page", "Pages", "PagesUnavailable"]

_log = logging.getLogger(__name__)

_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python names it from 3.12 on


class PagesUnavailable(CrossoverError, OSError):
    """This kernel or Python cannot make sealed shared pages (no memfd_create): ranks take the usual path."""


@dataclass
class Page:
    """One rank's page: its writable and read-only descriptors, the daemon's mapping, the ticket it owes."""

    id: int
    fd: int
    ro_fd: int
    _map: mmap.mmap = field(repr=False)
    owed: int = 0  # the ticket the rank's device is to store (0: none owed)
    owed_since: float = 0.0

    @property
    def word(self) -> int:
        return int(WORD.unpack_from(self._map, 0)[0])

    @property
    def owes(self) -> bool:
        """Whether the rank's device has a ticket still to store."""
        return bool(self.owed) and not reached(self.word, self.owed)

    def store(self, ticket: int) -> None:
        """What the rank's device would store; the daemon does it for a rank that cannot any more."""
        WORD.pack_into(self._map, 0, ticket)


class Pages:
    """Every page of this daemon, by session id."""

    def __init__(self) -> None:
        if not hasattr(os, "memfd_create"):
            raise PagesUnavailable("os.memfd_create is not available")
        self._ids = itertools.count(1)
        self._by_session: dict[str, Page] = {}

    @classmethod
    def if_possible(cls) -> Pages | None:
        """Pages, or None (said in one warning) where this kernel or Python cannot make them."""
        try:
            return cls()
        except PagesUnavailable as exc:
            _log.warning("no hand-over on the device on this node (%s): ranks end their turns on their CPUs", exc)
            return None

    def open(self, session_id: str) -> Page:
        """A new page for the session (its word 0). PagesUnavailable when the kernel refuses one."""
        try:
            fd = os.memfd_create(f"crossover-turns-{session_id[:8]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise PagesUnavailable(f"memfd_create: {exc}") from exc
        try:
            os.ftruncate(fd, PAGE_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            raise PagesUnavailable(f"sealing a turn page: {exc}") from exc
        try:
            mapped = mmap.mmap(fd, PAGE_BYTES)
        except OSError as exc:
            os.close(ro_fd)
            os.close(fd)
            raise PagesUnavailable(f"mapping a turn page: {exc}") from exc
        page = Page(next(self._ids), fd, ro_fd, mapped)
        self._by_session[session_id] = page
        return page

    def of(self, session_id: str) -> Page | None:
        return self._by_session.get(session_id)

    def seal(self, session_id: str) -> bool:
        """The rank has mapped its page: no new writable mapping of it from now on, by anyone (the daemon's and
        the rank's stay). False when the kernel cannot (before Linux 5.1): then no other rank may get it."""
        page = self._by_session.get(session_id)
        if page is None:
            return False
        try:
            fcntl.fcntl(page.fd, fcntl.F_ADD_SEALS, _FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            _log.warning("cannot seal a turn page against new writers (%s): its rank waits for its device on its "
                         "CPU", exc)
            return False
        return True

    def released(self, session_id: str, ticket: int, now: float) -> Page | None:
        """The session released its turn with `ticket`, which its device will store; its page."""
        page = self._by_session.get(session_id)
        if page is not None and ticket:
            page.owed, page.owed_since = ticket, now
        return page

    def rescue(self, session_id: str) -> int:
        """Store the ticket the session's device still owes (its rank is gone or stuck); the ticket, or 0."""
        page = self._by_session.get(session_id)
        if page is None or not page.owes:
            return 0
        page.store(page.owed)
        return page.owed

    def overdue(self, now: float, after_s: float) -> list[str]:
        """The sessions whose device has owed its ticket for longer than `after_s`."""
        return [sid for sid, page in self._by_session.items()
                if page.owes and now - page.owed_since > after_s]

    def close(self, session_id: str) -> int:
        """The session ended: store what it owed (see `rescue`) and free its page; the ticket stored, or 0."""
        stored = self.rescue(session_id)
        page = self._by_session.pop(session_id, None)
        if page is not None:
            page._map.close()
            os.close(page.ro_fd)
            os.close(page.fd)
        return stored

    def close_all(self) -> None:
        for sid in list(self._by_session):
            self.close(sid)
