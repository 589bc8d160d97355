"""Every phase change the daemon sees, in memory (bounded) and optionally as JSON lines.

Tests and benchmarks read it to check invariants (no two compute grants
overlap on a device) and to draw timelines.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable

__all__ = ["EventLog", "read_jsonl"]

_log = logging.getLogger(__name__)


class EventLog:
    """Append-only record of events, each a flat dict with `t` (monotonic) and `wall`."""

    def __init__(
        self,
        maxlen: int = 100_000,
        path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall_clock
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        entry = {"t": self._clock(), "wall": self._wall(), "event": event, **fields}
        line = json.dumps(entry, separators=(",", ":")) if self._file else None
        with self._lock:
            self._events.append(entry)
            if self._file is not None and line is not None:
                try:
                    self._file.write(line + "\n")
                except OSError as exc:  # a full disk must not stop scheduling
                    _log.error("event log file write failed, keeping memory log only: %s", exc)
                    self._file = None
        return entry

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Load an event log file written with `EventLog(path=...)`; a torn last line is skipped."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
