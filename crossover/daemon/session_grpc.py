"""The Session RPC: a rank's session stream over gRPC, served as coroutines on the daemon's event loop.

Reading an event, deciding and writing the grant happen on the loop's one
thread, which keeps the grant round trip short. The lifecycle is
`session_stream.SessionLifecycle`, shared with the session socket.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from crossover.daemon.api import CrossoverError, InvalidRequest
from crossover.daemon.limits import Connections, StreamLimits
from crossover.daemon.messages import CloseMsg, Message
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.session_stream import SessionLifecycle, directive, error_text, refusal, too_many
from crossover.protos import crossover_v1_pb2 as pb

__all__ = ["GrpcSessionStream", "serve_session"]

_log = logging.getLogger(__name__)

# A rank reads every directive at once; one whose directives pile up (a full flow-control
# window) stopped reading: it is dropped, as the session socket drops it, instead of the
# daemon queueing an answer to each of its heartbeats for as long as it keeps sending them.
_MAX_UNSENT = 256
_WRITE_TIMEOUT_S = 5.0


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
        await self._context.abort(*refusal(exc))


async def serve_session(core: Scheduler, stream: GrpcSessionStream, limits: StreamLimits,
                        connections: Connections) -> None:
    """Attach the stream's session to the scheduler and relay until either side ends it."""
    if not connections.enter():
        await stream.fail(too_many(connections))
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
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    stalled = asyncio.Event()
    loop_thread = threading.get_ident()

    def put(msg: Message) -> None:  # on the loop
        if inbox.qsize() < _MAX_UNSENT or isinstance(msg, CloseMsg):
            inbox.put_nowait(msg)
        elif not stalled.is_set():
            stalled.set()
            inbox.put_nowait(CloseMsg("stopped reading"))

    def deliver(msg: Message) -> None:  # called from any thread by the scheduler
        if threading.get_ident() == loop_thread:  # a grant decided while reading an event: no wake-up needed
            put(msg)
        else:
            loop.call_soon_threadsafe(put, msg)

    life = SessionLifecycle(core, limits)
    try:
        life.open(first, deliver)
        core.ownership.refuse_unnamed(life.sid)
    except CrossoverError as exc:
        if life.sid:
            core.close(life.sid, "refused")
        await stream.fail(exc)
        return
    reader = asyncio.create_task(_read(life, stream, inbox))
    try:
        while True:
            msg = await inbox.get()
            if isinstance(msg, CloseMsg) and msg.error is not None:
                await stream.fail(msg.error)
            if stalled.is_set():
                break
            if isinstance(msg, CloseMsg):
                return
            out = directive(msg)
            if out is not None:
                try:
                    await asyncio.wait_for(stream.write(out), _WRITE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    break
        life.reason = "stopped reading"
        _log.warning("dropping a rank's session: it stopped reading its gRPC stream")
    finally:
        reader.cancel()
        core.close(life.sid, "stream closed")


async def _read(life: SessionLifecycle, stream: GrpcSessionStream, inbox: asyncio.Queue) -> None:
    try:
        while True:
            try:
                ev = await stream.read()
                if ev is None:
                    return
                life.receive(ev)
            except CrossoverError as exc:
                life.refused(exc)
                inbox.put_nowait(CloseMsg(error_text(exc), exc))
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the peer vanished mid-read (process killed, connection reset)
        _log.info("session %s: stream broken (%s: %s)", life.sid[:8], type(exc).__name__, error_text(exc))
        life.reason = "stream broken"
    finally:
        life.close()
