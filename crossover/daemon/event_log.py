"""Every phase change the daemon sees, in memory (bounded) and optionally as JSON lines.

Tests and benchmarks read it to check invariants (no two compute grants
overlap on a device) and to draw timelines.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable

from crossover.protos.event_file import Event, encode, header, rotated_paths, typed
from crossover.protos.event_records import RANK_KEYS, RankTag, Record

__all__ = ["BACKUPS", "EventLog", "MAXLEN", "MAX_BYTES"]

_log = logging.getLogger(__name__)

MAXLEN = 100_000
"""Events kept in memory by default (crossoverd --event-log-size)."""
BACKUPS = 3
"""Rotated files kept by default (crossoverd --event-log-backups)."""
MAX_BYTES = 64 << 20
"""A file rotates before it grows past this size by default (crossoverd --event-log-max-mb)."""


class EventLog:
    """Append-only record of events, each a flat dict with `t` (monotonic) and `wall`.

    With a `path`, events are also written there as JSON lines by a writer
    thread every `flush_interval_s`: encoding and writing stay off the thread
    that decides grants. A daemon killed with SIGKILL loses at most that last
    interval of the file (the in-memory log is complete); `close()` writes the rest.

    The file is rotated like any daemon's log before it grows past `max_bytes`
    (0: never): `path` becomes `path.1`, `path.1` becomes `path.2`, and so on up
    to `backups` (the oldest is deleted), so clients cannot fill the disk through it.

    Entries wait for the writer in a queue of at most `maxlen`; a write that fails
    (a full disk, a removed folder) is retried every `retry_s`, the file reopened if
    need be, and reported when it fails and again when it works. `recorded` counts
    entries recorded, `dropped` those the file lost (the queue overflowed while
    writes failed; they stay in memory); listeners see every entry as it is recorded.
    """

    def __init__(
        self,
        maxlen: int = MAXLEN,
        path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        flush_interval_s: float = 0.1,
        max_bytes: int = MAX_BYTES,
        backups: int = BACKUPS,
        retry_s: float = 1.0,
    ) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall_clock
        self._file: IO[str] | None = None
        self._unwritten: list[dict[str, Any]] = []
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        self._path = Path(path) if path is not None else None
        self._max_bytes = max_bytes
        self._backups = backups
        self._size = 0
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._max_unwritten = maxlen
        self._retry_s = retry_s
        self._retry_at = 0.0
        self._failures = 0
        self.recorded = 0
        self.dropped = 0
        if path is not None:
            self._file = self._open()
            self._writer = threading.Thread(target=self._write_loop, args=(flush_interval_s,),
                                            name="event-log-writer", daemon=True)
            self._writer.start()

    def _open(self) -> IO[str]:
        """Open the file for appending; a new (empty) one starts with the format's header line."""
        assert self._path is not None
        f = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._size = f.tell()
        if not self._size:
            f.write(header(writer="crossoverd"))
            f.flush()
            self._size = f.tell()
        return f

    def record(self, record: Record, t: float | None = None, about: RankTag | None = None) -> dict[str, Any]:
        """Append one event, its name and payload from `record`; `about`: the rank it is about (none: the node's
        or a device's event); `t` dates it earlier than now (a rank reported it late). Returns the line's object:
        `t`, `wall`, `event`, the rank's tag, the payload."""
        now, wall = self._clock(), self._wall()
        if t is not None:
            wall -= now - t
            now = t
        tag, fields = about.fields() if about is not None else {}, record.fields()
        entry = {"t": now, "wall": wall, "event": str(record.name), **tag, **fields}
        if len(entry) != 3 + len(tag) + len(fields):  # a payload key is one of the tag's, which it would hide
            raise ValueError(f"a {record.name} event about a rank takes its {', '.join(RANK_KEYS)} from its tag")
        with self._lock:
            self._events.append(entry)
            self.recorded += 1
            if self._path is not None and not self._closed.is_set():
                self._unwritten.append(entry)
                if len(self._unwritten) > self._max_unwritten:  # writes fail and the queue is full: oldest go
                    del self._unwritten[0]
                    self.dropped += 1
        for listener in self._listeners:
            try:
                listener(entry)
            except Exception:  # a listener (metrics) must never stop scheduling
                _log.exception("event log listener failed on %s", record.name)
        return entry

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(entry)` with every entry recorded from now on, on the recording thread
        (often under the scheduler's lock): it must be quick and must not call back into the daemon."""
        self._listeners.append(listener)

    def snapshot(self) -> list[dict[str, Any]]:
        """The entries in memory, as the objects of their lines."""
        with self._lock:
            return list(self._events)

    def events(self) -> list[Event]:
        """The entries in memory, typed (`crossover.protos.event_file.Event`)."""
        return typed(self.snapshot())

    def flush(self) -> None:
        """Write the events recorded since the last flush to the file (if any); after a failed write,
        not before `retry_s` has passed."""
        if self._path is None or (self._failures and time.monotonic() < self._retry_at):
            return
        with self._lock:
            batch, self._unwritten = self._unwritten, []
            f = self._file
        if not batch:
            return
        text = "".join(map(encode, batch))
        try:
            if f is None or f.closed:
                f = self._open()
                with self._lock:
                    self._file = f
            if self._max_bytes and self._size and self._size + len(text) > self._max_bytes:
                f = self._rotate(f)
            f.write(text)
            f.flush()
            self._size += len(text)
        except (OSError, ValueError) as exc:  # a full disk must not stop scheduling, nor end the log
            self._failures += 1
            self._retry_at = time.monotonic() + self._retry_s
            if self._failures == 1:
                _log.error("event log file write failed (%s); keeping up to %d entries and retrying every %g s",
                           exc, self._max_unwritten, self._retry_s)
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    f.close()
            with self._lock:
                self._file = None
                queued = batch + self._unwritten
                over = max(0, len(queued) - self._max_unwritten)
                self._unwritten = queued[over:]
                self.dropped += over
            return
        if self._failures:
            _log.warning("event log file writes work again after %d failed attempt(s); %d entries lost meanwhile",
                         self._failures, self.dropped)
            self._failures = 0

    def _rotate(self, f: IO[str]) -> IO[str]:
        """Shift the files one place (dropping the oldest) and start an empty one; by the writer only."""
        assert self._path is not None
        f.close()
        files = rotated_paths(self._path, self._backups)
        files[-1].unlink(missing_ok=True)
        for newer, older in reversed(list(zip(files, files[1:]))):
            if newer.exists():
                newer.rename(older)
        new = self._open()
        with self._lock:
            self._file = new
        return new

    def close(self) -> None:
        self._closed.set()
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(5)
        self._failures = 0  # a last try, whenever the previous one failed
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write_loop(self, interval: float) -> None:
        # One writer at a time: close() joins this thread before its own final flush.
        while not self._closed.wait(interval):
            self.flush()
