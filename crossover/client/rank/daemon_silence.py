"""Whether a rank's daemon still answers: a daemon stopped (SIGSTOP), swapped out or deadlocked is one
whose heartbeats go unanswered, and its ranks train unscheduled until it answers again.

Pure: the session reports what it sent and heard, with its own clock's time.
"""
from __future__ import annotations

__all__ = ["Silence"]


class Silence:
    """Heartbeats without an answer, and the verdict: `frozen` once one went unanswered for `limit_s`."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.answers = False  # this daemon answers heartbeats at all (Directive.alive)
        self.since: float | None = None  # when the oldest heartbeat not yet answered went out
        self.frozen = False

    def reset(self) -> None:
        """A new stream: nothing sent, nothing known."""
        self.answers, self.since, self.frozen = False, None, False

    def sent(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def heard(self) -> bool:
        """Any directive answers every heartbeat sent before it (the stream keeps order); True when the
        daemon was taken for frozen until now."""
        self.since = None
        was, self.frozen = self.frozen, False
        return was

    def check(self, now: float) -> float:
        """How long the daemon has been silent, when that just made it `frozen`; 0 otherwise."""
        if self.frozen or not self.answers or self.since is None or now - self.since < self.limit_s:
            return 0.0
        self.frozen = True
        return now - self.since
