"""A rank's Session stream, whichever way it travels: the gRPC stream or the session socket.

Both carry the same messages, validated and applied the same way
(`apply_event`), and end the same way: gRPC streams run as coroutines on the
daemon's event loop (`serve_session`), session socket connections on threads.
The session socket (`SessionSocketServer`) exists because a grant's round
trip through gRPC Python costs about 0.5 ms on a small VM before the daemon
does anything, while length-prefixed frames on a Unix socket, read by a thread
per rank, cost a fraction of that.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from typing import Any

import grpc

from ..protos import MAX_BATCH_EVENTS, framing
from ..protos import crossover_v1_pb2 as pb
from .api import (
    AlreadyExists,
    CrossoverError,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    ResourceExhausted,
    UnsupportedVersion,
)
from .limits import Connections, EventBudget, StreamLimits
from .scheduler import AliveMsg, CloseMsg, GrantMsg, LeaseMsg, PolicyMsg, Scheduler, ShareMsg

__all__ = ["GrpcSessionStream", "SessionSocketServer", "apply_event", "error_text", "serve_session", "status_code"]

_log = logging.getLogger(__name__)

_KINDS = {
    pb.COMPUTE_REQUEST: "compute_request",
    pb.COMPUTE_DONE: "compute_done",
    pb.COMM_BEGIN: "comm_begin",
    pb.COMM_END: "comm_end",
    pb.HEARTBEAT: "heartbeat",
    pb.LEASE_RELEASED: "lease_released",
}


def status_code(exc: Exception) -> grpc.StatusCode:
    """The gRPC status a domain error travels as (on the session socket: its name)."""
    for cls, code in (
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound, grpc.StatusCode.NOT_FOUND),
        (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (UnsupportedVersion, grpc.StatusCode.FAILED_PRECONDITION),
        (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
        (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ):
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


_MAX_ERROR_TEXT = 300


def error_text(exc: Exception) -> str:
    """An error's message as it goes on the wire: cut short, because it may quote what a client sent."""
    text = str(exc)
    if len(text) <= _MAX_ERROR_TEXT:
        return text
    return f"{text[:_MAX_ERROR_TEXT]}... ({len(text)} characters)"


_OPEN_FIRST = "the first event of a session must be OPEN with the session_id from Register"


async def serve_session(core: Scheduler, stream: GrpcSessionStream, limits: StreamLimits,
                        connections: Connections) -> None:
    """Attach the stream's session to the scheduler and relay until either side ends it."""
    if not connections.enter():
        await stream.fail(_too_many(connections))
        return
    try:
        await _serve_session(core, stream, limits)
    finally:
        connections.leave()


async def _serve_session(core: Scheduler, stream: GrpcSessionStream, limits: StreamLimits) -> None:
    try:
        first = await asyncio.wait_for(stream.read(), limits.open_timeout_s)
    except asyncio.TimeoutError:
        await stream.fail(InvalidRequest(f"no OPEN within {limits.open_timeout_s:g}s"))
        return
    if first is None:
        return
    try:
        sid = _opening(first)
    except InvalidRequest as exc:
        await stream.fail(exc)
        return
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    loop_thread = threading.get_ident()

    def deliver(msg: Any) -> None:  # called from any thread by the scheduler
        if threading.get_ident() == loop_thread:  # a grant decided while reading an event: no wake-up needed
            inbox.put_nowait(msg)
        else:
            loop.call_soon_threadsafe(inbox.put_nowait, msg)

    try:
        core.attach(sid, deliver)
    except CrossoverError as exc:
        await stream.fail(exc)
        return
    budget = limits.budget()
    reader = asyncio.create_task(_read(core, sid, stream, inbox, budget))
    try:
        while True:
            msg = await inbox.get()
            if isinstance(msg, CloseMsg):
                if msg.error is not None:
                    await stream.fail(msg.error)
                return
            directive = _directive(msg)
            if directive is not None:
                await stream.write(directive)
    finally:
        reader.cancel()
        core.close(sid, "stream closed")


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
    for one in events:
        kind = _KINDS.get(one.kind)
        if kind is None:
            where = "inside a BATCH" if one is not ev else "after OPEN"
            raise InvalidRequest(f"event kind {one.kind} is not valid {where}")
        core.event(sid, kind, one.iteration, one.seq, one.duration_s, one.turn_base,
                   comm_begins=one.comm_begins, no_wait=one.no_wait, requested=one.requested,
                   comm_s=one.comm_s, ago_s=one.ago_s if one is not ev else 0.0, yields=one.yields)


def _opening(first: pb.RankEvent) -> str:
    if first.kind != pb.OPEN or not first.session_id:
        raise InvalidRequest(_OPEN_FIRST)
    return first.session_id


def _directive(msg: Any) -> pb.Directive | None:
    if isinstance(msg, GrantMsg):
        return pb.Directive(grant=pb.Grant(seq=msg.seq, iteration=msg.iteration, waited_s=msg.waited_s))
    if isinstance(msg, LeaseMsg):
        return pb.Directive(lease=pb.Lease(held=msg.held))
    if isinstance(msg, PolicyMsg):
        return pb.Directive(policy=pb.PolicyUpdate(policy=msg.policy, policy_blocks=msg.blocks))
    if isinstance(msg, ShareMsg):
        return pb.Directive(share=pb.DeviceShare(other_ranks=msg.other_ranks))
    if isinstance(msg, AliveMsg):
        return pb.Directive(alive=pb.Alive())
    return None


async def _read(core: Scheduler, sid: str, stream: GrpcSessionStream, inbox: asyncio.Queue,
                budget: EventBudget) -> None:
    reason = "stream ended"
    try:
        while True:
            try:
                ev = await stream.read()
                if ev is None:
                    return
                apply_event(core, sid, ev, budget)
            except CrossoverError as exc:
                _log.warning("closing session %s: %s", sid[:8], error_text(exc))
                inbox.put_nowait(CloseMsg(error_text(exc), exc))
                reason = f"invalid event: {error_text(exc)}"
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the peer vanished mid-read (process killed, connection reset)
        _log.info("session %s: stream broken (%s: %s)", sid[:8], type(exc).__name__, error_text(exc))
        reason = "stream broken"
    finally:
        core.close(sid, reason)


class GrpcSessionStream:
    """The Session RPC's stream: None at its end, a gRPC status to fail it."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def read(self) -> pb.RankEvent | None:
        ev = await self._context.read()
        return None if ev is grpc.aio.EOF else ev

    async def write(self, directive: pb.Directive) -> None:
        await self._context.write(directive)

    async def fail(self, exc: Exception) -> None:
        await self._context.abort(status_code(exc), error_text(exc))


def _too_many(connections: Connections) -> ResourceExhausted:
    return ResourceExhausted(f"this daemon serves at most {connections.cap} session streams at once "
                             "(crossoverd --max-connections)")


class _FrameConnection:
    """One rank on the session socket, served by its own thread.

    A thread blocked in recv wakes sooner than an event loop blocked in epoll
    (measured on a 2-vCPU VM after 50 ms idle: 0.22 vs 0.40-0.49 ms per round
    trip), and grants are written straight from whichever thread decides them.
    Writes never wait: a rank whose socket buffer is full stopped reading long
    ago, and its connection is dropped rather than let it stall the scheduler.
    A connection that does not OPEN in time, or then falls silent, is closed
    (`StreamLimits`), so no thread waits forever on a client that left half-way.
    """

    def __init__(self, core: Scheduler, conn: socket.socket, limits: StreamLimits) -> None:
        self._core = core
        self._conn = conn
        self._limits = limits
        self._write_lock = threading.Lock()
        self._frames = framing.FrameReader(conn.recv)

    def serve(self) -> None:
        sid = ""  # set once this connection is the session's stream
        reason = "stream ended"
        try:
            _receive_timeout(self._conn, self._limits.open_timeout_s)
            first = self._read()
            if first is None:
                return
            opened = _opening(first)
            self._core.attach(opened, self._deliver)
            sid = opened
            _receive_timeout(self._conn, self._limits.idle_timeout_s)
            budget = self._limits.budget()
            while (ev := self._read()) is not None:
                apply_event(self._core, sid, ev, budget)
        except CrossoverError as exc:
            if sid:
                _log.warning("closing session %s: %s", sid[:8], error_text(exc))
                reason = f"invalid event: {error_text(exc)}"
            self._fail(exc)
        except BlockingIOError:  # the receive timeout
            reason = "stream silent"
            self._fail(InvalidRequest("no OPEN in time" if not sid else "no event in time"))
        except OSError:  # the peer vanished mid-read (process killed, connection reset)
            reason = "stream broken"
        finally:
            if sid:
                self._core.close(sid, reason)
            self._drop()
            self._conn.close()

    def _read(self) -> pb.RankEvent | None:
        """The next event; None at a clean end. InvalidRequest on a malformed frame."""
        try:
            return self._frames.next_message(pb.RankEvent)
        except framing.FrameError as exc:
            raise InvalidRequest(str(exc)) from None

    def _deliver(self, msg: Any) -> None:  # from any thread, never blocking (the scheduler's contract)
        if isinstance(msg, CloseMsg):
            if msg.error is not None:
                self._fail(msg.error)
            self._drop()
            return
        directive = _directive(msg)
        if directive is not None and not self._write(framing.encode(directive)):
            self._drop()

    def _write(self, data: bytes) -> bool:
        with self._write_lock:
            try:
                if self._conn.send(data, socket.MSG_DONTWAIT) == len(data):
                    return True
            except BlockingIOError:
                pass
            except OSError:  # the peer is gone: its reading thread sees the end too
                return False
            _log.warning("dropping a rank's session: it stopped reading the session socket")
            return False

    def _fail(self, exc: Exception) -> None:
        self._write(framing.encode(pb.Directive(error=pb.SessionError(code=status_code(exc).name,
                                                                      message=error_text(exc)))))

    def _drop(self) -> None:
        """End the connection; the serving thread sees it and closes the session."""
        framing.shut(self._conn)


def _receive_timeout(conn: socket.socket, seconds: float) -> None:
    """A kernel receive timeout (recv then fails with EAGAIN). Not `settimeout`, which would
    also make the never-waiting writes (MSG_DONTWAIT) wait for room in the buffer."""
    whole = int(seconds)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class SessionSocketServer:
    """Serves Session streams as frames on a Unix socket: an accepting thread, and a thread per rank
    (at most `connections.cap` streams with the gRPC ones; one more is refused with RESOURCE_EXHAUSTED)."""

    def __init__(self, core: Scheduler, path: str, limits: StreamLimits, connections: Connections) -> None:
        self._core = core
        self.path = path
        self._limits = limits
        self._connections = connections
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        threading.Thread(target=self._accept, name="session-accept", daemon=True).start()

    def stop(self) -> None:
        """Stop accepting and end every connection (their sessions close)."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        if self._sock is not None:
            framing.shut(self._sock)  # wakes the accepting thread
            self._sock.close()
        for c in conns:
            framing.shut(c)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
            if not self._connections.enter():
                _log.warning("refusing a session socket connection: %d streams open, the limit",
                             self._connections.cap)
                _FrameConnection(self._core, conn, self._limits)._fail(_too_many(self._connections))
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="session-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _FrameConnection(self._core, conn, self._limits).serve()
        except Exception:  # a bug here must not take the daemon down
            _log.exception("session socket connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._connections.leave()
