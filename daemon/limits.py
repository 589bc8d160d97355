"""What one client may cost the daemon: events per second, connections, idle time.

A rank sends a few events per iteration; a client that sends thousands a
second, or opens connections and never speaks, would otherwise fill the event
log's disk and the daemon's thread table. These limits are far above what a
training rank needs and end only the client that goes past them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Connections", "EventBudget", "StreamLimits"]


@dataclass(frozen=True)
class StreamLimits:
    """The daemon's limits on session streams (flags of `crossoverd`)."""

    events_per_s: float = 20_000.0  # sustained rate per session (a rank sends a few per collective); 0: none
    max_connections: int = 1024  # session streams open at once, both transports together
    open_timeout_s: float = 5.0  # a session socket connection must send OPEN within this
    idle_timeout_s: float = 60.0  # ... and then some frame at least this often (ranks heartbeat every 0.2 s)

    def budget(self) -> EventBudget:
        """A new session's event budget: `events_per_s`, in bursts of up to twice that."""
        return EventBudget(self.events_per_s, int(2 * self.events_per_s))


class EventBudget:
    """A token bucket: `spend(n)` is False once a session sends faster than `per_s` beyond `burst`."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._burst = float(max(burst, 1))
        self._clock = clock
        self._tokens = self._burst
        self._at = clock()

    def spend(self, n: int) -> bool:
        if self._per_s <= 0:
            return True
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if n > self._tokens:
            return False
        self._tokens -= n
        return True


class Connections:
    """Session streams open now, counted against `cap` across both transports."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._n = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """Count one more; False (and not counted) when `cap` are open already."""
        with self._lock:
            if self._n >= self.cap:
                return False
            self._n += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._n -= 1

    @property
    def count(self) -> int:
        return self._n
