"""A rank's Session stream, whichever way it travels: the gRPC stream or the session socket.

Both transports carry the same messages and feed one lifecycle
(`SessionLifecycle`): OPEN attaches the stream to its session, every event
after it goes through `apply_event`, an invalid one ends the stream with its
error, and the session closes with the stream's end. gRPC streams run as
coroutines on the daemon's event loop (`session_grpc`), session socket
connections on a thread each (`session_socket`).
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc

from crossover.daemon import rpc_errors
from crossover.daemon.api import (
    AlreadyExists,
    CrossoverError,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    UnsupportedVersion,
)
from crossover.daemon.events import RankEvent
from crossover.daemon.limits import Connections, EventBudget, StreamLimits
from crossover.daemon.messages import (
    AliveMsg,
    ClassMsg,
    GrantMsg,
    LeaseMsg,
    Message,
    PageMsg,
    PolicyMsg,
    PreemptMsg,
    ShareMsg,
)
from crossover.daemon.scheduler import Scheduler
from crossover.protos import MAX_BATCH_EVENTS
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos.priority import to_wire

__all__ = ["SessionLifecycle", "apply_event", "directive", "error_text", "refusal", "status_code", "too_many"]

_log = logging.getLogger(__name__)

_MAX_ERROR_TEXT = 300
_OPEN_FIRST = "the first event of a session must be OPEN with the session_id from Register"


def status_code(exc: Exception) -> grpc.StatusCode:
    """The gRPC status a domain error travels as (on the session socket: its name)."""
    for cls, code in (
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound, grpc.StatusCode.NOT_FOUND),
        (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (UnsupportedVersion, grpc.StatusCode.FAILED_PRECONDITION),
        (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
        (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    ):
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def refusal(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message an error ends a call with, counted (`rpc_errors`)."""
    code = status_code(exc)
    rpc_errors.count(code)
    return code, error_text(exc)


def error_text(exc: Exception) -> str:
    """An error's message as it goes on the wire: cut short, because it may quote what a client sent."""
    text = str(exc)
    if len(text) <= _MAX_ERROR_TEXT:
        return text
    return f"{text[:_MAX_ERROR_TEXT]}... ({len(text)} characters)"


def too_many(connections: Connections, uid: int | None = None) -> ResourceExhausted:
    """The refusal of a stream past the daemon's cap, or past one user's share of it."""
    if connections.full_for(uid):
        return ResourceExhausted(f"this user (uid {uid}) has {connections.per_uid} session streams open, the most "
                                 "one user may hold (crossoverd --max-connections-per-user)")
    return ResourceExhausted(f"this daemon serves at most {connections.cap} session streams at once "
                             "(crossoverd --max-connections)")


def apply_event(core: Scheduler, sid: str, ev: pb.RankEvent, budget: EventBudget | None = None) -> None:
    """Hand one message of an open stream (a BATCH: each event in it) to the scheduler.

    InvalidRequest for a malformed event or a BATCH over MAX_BATCH_EVENTS; ResourceExhausted
    once the session sends faster than its `budget` allows.
    """
    events = ev.batch if ev.kind == pb.BATCH else (ev,)
    if len(events) > MAX_BATCH_EVENTS:
        raise InvalidRequest(f"a BATCH of {len(events)} events; the limit is {MAX_BATCH_EVENTS}")
    if budget is not None and not budget.spend(max(len(events), 1)):
        raise ResourceExhausted("the session sends events faster than this daemon allows "
                                "(crossoverd --max-events-per-s); a training rank sends a few per iteration")
    core.apply_message(sid, [RankEvent.from_pb(one, in_batch=one is not ev) for one in events])


def directive(msg: Message) -> pb.Directive | None:
    """The wire form of a message for the rank; None for the ones that end the stream instead."""
    if isinstance(msg, GrantMsg):
        return pb.Directive(grant=pb.Grant(seq=msg.seq, iteration=msg.iteration, waited_s=msg.waited_s,
                                           after_page=msg.after_page, after_ticket=msg.after_ticket))
    if isinstance(msg, LeaseMsg):
        return pb.Directive(lease=pb.Lease(held=msg.held))
    if isinstance(msg, PolicyMsg):
        return pb.Directive(policy=pb.PolicyUpdate(policy=msg.policy, policy_blocks=msg.blocks))
    if isinstance(msg, ShareMsg):
        return pb.Directive(share=pb.DeviceShare(other_ranks=msg.other_ranks, handover=msg.handover,
                                                 outranked=msg.outranked, memory_cap_bytes=msg.memory_cap.limit,
                                                 memory_cap_why=msg.memory_cap.why))  # None leaves it unset
    if isinstance(msg, AliveMsg):
        return pb.Directive(alive=pb.Alive())
    if isinstance(msg, ClassMsg):
        return pb.Directive(job_class=pb.JobClassUpdate(priority=to_wire(str(msg.cls.priority)),
                                                        weight=msg.cls.weight, note=msg.note))
    if isinstance(msg, PreemptMsg):
        return pb.Directive(preempt=pb.Preempt())
    if isinstance(msg, PageMsg):
        return pb.Directive(handover_page=pb.HandoverPage(page=msg.page, own=msg.own))
    return None


class SessionLifecycle:
    """One session stream from its OPEN to its end, as every transport drives it.

    `open` attaches the stream; `receive` applies each later message; `refused`
    records that the stream sent something invalid; `close` ends the session with
    the stream's `reason` ("stream ended" unless the transport says otherwise).
    """

    def __init__(self, core: Scheduler, limits: StreamLimits) -> None:
        self.sid = ""  # set once the stream is its session's
        self.reason = "stream ended"
        self._core = core
        self._limits = limits
        self._budget: EventBudget | None = None

    def open(self, first: pb.RankEvent, deliver: Callable[[Message], None], passes_fds: bool = False) -> None:
        """The stream's first message must be OPEN for a registered session; `deliver` gets its messages
        (`passes_fds`: it can send a `PageMsg`'s descriptor along). CrossoverError otherwise (the stream is
        then no session's)."""
        if first.kind != pb.OPEN or not first.session_id:
            raise InvalidRequest(_OPEN_FIRST)
        self._core.attach(first.session_id, deliver, passes_fds=passes_fds)
        self.sid = first.session_id
        self._budget = self._limits.budget()

    def receive(self, ev: pb.RankEvent) -> None:
        apply_event(self._core, self.sid, ev, self._budget)

    def refused(self, exc: CrossoverError) -> None:
        """The stream sent something invalid and ends with `exc`."""
        if self.sid:
            _log.warning("closing session %s: %s", self.sid[:8], error_text(exc))
            self.reason = f"invalid event: {error_text(exc)}"

    def close(self) -> None:
        """End the session, if the stream had one."""
        if self.sid:
            self._core.close(self.sid, self.reason)
