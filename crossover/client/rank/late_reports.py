"""The phases a rank that does not wait for grants reports a few at a time, each dated by how long ago it ended.

A rank under a lease, or under a policy that does not block, waits for nothing: sending a
message per iteration would only cost it. Its iterations are held here and sent as one BATCH
once the oldest is `interval_s` old or the batch is full; the daemon dates each one back.
"""
from __future__ import annotations

from crossover.protos import MAX_BATCH_EVENTS
from crossover.protos import crossover_v1_pb2 as pb

__all__ = ["LateReports"]


class LateReports:
    """Events held for a BATCH, each with the time it happened (the session's clock)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._held: list[tuple[pb.RankEvent, float]] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, event: pb.RankEvent, now: float) -> bool:
        """Keep `event`, which happened at `now`; True when the batch is due (send `take` now)."""
        self._held.append((event, now))
        return now - self._held[0][1] >= self.interval_s or len(self._held) >= MAX_BATCH_EVENTS

    def take(self, now: float) -> pb.RankEvent | None:
        """The BATCH of every held event, each dated `ago_s` before `now`; None when none is held."""
        if not self._held:
            return None
        batch = pb.RankEvent(kind=pb.BATCH)
        for event, at in self._held:
            event.ago_s = max(0.0, now - at)
            batch.batch.append(event)
        self._held.clear()
        return batch
