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
    frame_timeout_s: float = 2.0  # once a frame has begun, all of it must arrive within this
    max_connections_per_uid: int = 256  # session socket streams one local user may hold open

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
    """Session streams open now, counted against `cap` across both transports, and per local user
    (the kernel's uid of a session socket peer) against `per_uid`."""

    def __init__(self, cap: int, per_uid: int | None = None) -> None:
        self.cap = cap
        self.per_uid = per_uid if per_uid is not None else cap
        self._n = 0
        self._by_uid: dict[int, int] = {}
        self._lock = threading.Lock()

    def enter(self, uid: int | None = None) -> bool:
        """Count one more; False (and not counted) when `cap` are open already, or `per_uid` of `uid`'s."""
        with self._lock:
            if self._n >= self.cap or (uid is not None and self._by_uid.get(uid, 0) >= self.per_uid):
                return False
            self._n += 1
            if uid is not None:
                self._by_uid[uid] = self._by_uid.get(uid, 0) + 1
            return True

    def leave(self, uid: int | None = None) -> None:
        with self._lock:
            self._n -= 1
            if uid is not None:
                left = self._by_uid.get(uid, 0) - 1
                if left > 0:
                    self._by_uid[uid] = left
                else:
                    self._by_uid.pop(uid, None)

    def full_for(self, uid: int | None) -> bool:
        """Whether `uid` holds its whole share (the refusal then names the per-user cap)."""
        with self._lock:
            return uid is not None and self._by_uid.get(uid, 0) >= self.per_uid

    @property
    def count(self) -> int:
        return self._n

    def by_uid(self) -> dict[int, int]:
        """Open session socket streams per local user."""
        with self._lock:
            return dict(self._by_uid)
