"""The scheduler's input and output records: one rank event in, the event-log entries of a decision out.

A `RankEvent` is built once at the edge (from the wire, or by a caller of
`Scheduler.event`) and validated there; the scheduler consumes it. What the
scheduler decides is a `Decision`: the log entries it made (each written by
`record_rank`, the one layout of an entry about a rank) and the messages that
wait for those entries to be logged before they reach their sessions.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crossover.daemon.api import InvalidRequest
from crossover.daemon.messages import Message
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos.event_records import RankTag, Record

if TYPE_CHECKING:
    from crossover.daemon.event_log import EventLog
    from crossover.daemon.registry import Session

__all__ = ["Decision", "EventKind", "RankEvent", "record_rank"]

_MAX_PHASE_S = 86_400


class EventKind(enum.Enum):
    """What a rank reports on its open stream."""

    COMPUTE_REQUEST = "compute_request"
    COMPUTE_DONE = "compute_done"
    COMM_BEGIN = "comm_begin"
    COMM_END = "comm_end"
    HEARTBEAT = "heartbeat"
    LEASE_RELEASED = "lease_released"
    HANDOVER_READY = "handover_ready"
    MEMORY_CAP_HIT = "memory_cap_hit"


_WIRE_KINDS = {
    pb.COMPUTE_REQUEST: EventKind.COMPUTE_REQUEST,
    pb.COMPUTE_DONE: EventKind.COMPUTE_DONE,
    pb.COMM_BEGIN: EventKind.COMM_BEGIN,
    pb.COMM_END: EventKind.COMM_END,
    pb.HEARTBEAT: EventKind.HEARTBEAT,
    pb.LEASE_RELEASED: EventKind.LEASE_RELEASED,
    pb.HANDOVER_READY: EventKind.HANDOVER_READY,
    pb.MEMORY_CAP_HIT: EventKind.MEMORY_CAP_HIT,
}


@dataclass
class RankEvent:
    """One rank event, its fields checked for plausibility (`InvalidRequest` otherwise).

    The fields mean what the wire's `RankEvent` says they mean (see the .proto);
    `ago_s` is non-zero only for an event that arrived inside a BATCH.
    """

    kind: EventKind
    iteration: int = 0
    seq: int = 0
    duration_s: float = 0.0
    comm_begins: bool = False
    no_wait: bool = False
    requested: bool = False
    comm_s: float = 0.0
    ago_s: float = 0.0
    yields: bool = False
    handover_ticket: int = 0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in (("duration_s", self.duration_s), ("comm_s", self.comm_s), ("ago_s", self.ago_s)):
            if value < 0 or value > _MAX_PHASE_S or value != value:
                raise InvalidRequest(f"{name}={value} is not a plausible phase length")
        if self.iteration < -1:
            raise InvalidRequest(f"iteration={self.iteration} is negative")

    @classmethod
    def from_pb(cls, ev: pb.RankEvent, in_batch: bool) -> RankEvent:
        """The typed form of one wire event (not OPEN, not BATCH); only one `in_batch` keeps its `ago_s`."""
        kind = _WIRE_KINDS.get(ev.kind)
        if kind is None:
            where = "inside a BATCH" if in_batch else "after OPEN"
            raise InvalidRequest(f"event kind {ev.kind} is not valid {where}")
        return cls(kind, ev.iteration, ev.seq, ev.duration_s, comm_begins=ev.comm_begins,
                   no_wait=ev.no_wait, requested=ev.requested, comm_s=ev.comm_s,
                   ago_s=ev.ago_s if in_batch else 0.0, yields=ev.yields,
                   handover_ticket=ev.handover_ticket, memory_bytes=ev.memory_bytes)


def record_rank(log: EventLog, record: Record, sess: Session, node: str, t: float | None) -> None:
    """Append one event-log line about a rank, dated `t` (None: when written):
    `{"t", "wall", "event", "job", "job_name", "rank", "device", "node", <record's fields>}`, in that order."""
    ident = sess.ident
    log.record(record, t=t, about=RankTag(job=ident.job_id, job_name=ident.job_name, rank=ident.rank,
                                          device=sess.ref.device, node=node))


@dataclass
class _Pending:
    record: Record
    session: Session
    t: float | None = None


class Decision:
    """What one decision did, collected under the scheduler's lock and then `commit`ted:
    its log entries first, then its messages, so that no rank acts on a grant or lease
    before the event log shows it."""

    def __init__(self) -> None:
        self._entries: list[_Pending] = []
        self._messages: list[tuple[Session, Message]] = []

    def log(self, sess: Session, record: Record) -> None:
        """Log `record` about the session's rank, when the decision is committed."""
        self._entries.append(_Pending(record, sess))

    def post(self, sess: Session, msg: Message) -> None:
        self._messages.append((sess, msg))

    def mark(self) -> int:
        """A place in the entries, for `date_since`."""
        return len(self._entries)

    def date_since(self, mark: int, t: float) -> None:
        """Date every entry logged since `mark` back to `t` (the rank reported them late)."""
        for entry in self._entries[mark:]:
            entry.t = t

    def commit(self, log: EventLog, node: str, now: float) -> None:
        """Write the entries, then send the messages.

        One decision is one instant: its entries are dated `now` (unless dated back), not by the
        log's clock as it writes them, and never before their rank's previous entry; else a rank's
        next dated-back phase could start before the end of its previous phase.
        """
        entries, self._entries = self._entries, []
        for e in entries:
            sess = e.session
            sess.last_t = t = max(now if e.t is None else e.t, sess.last_t)
            record_rank(log, e.record, sess, node, t)
        messages, self._messages = self._messages, []
        for sess, msg in messages:
            sess.send(msg)
