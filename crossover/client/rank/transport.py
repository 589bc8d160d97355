"""The two ways a rank's Session stream travels to its daemon.

`GrpcStream` is the Scheduler.Session RPC; it works against any daemon, local
or over TCP. `FrameStream` carries the same messages on the daemon's session
socket (see `crossover.protos.framing`): no HTTP/2 and no gRPC threads between
the training thread and the daemon, so a grant arrives several times sooner.
Neither ever blocks the training thread on a daemon that stopped reading.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import socket
from collections.abc import Iterator
from typing import Protocol

import grpc

from crossover.client.daemon_socket import missing_socket, untrusted_socket
from crossover.errors import CrossoverError
from crossover.protos import PROTOCOL_VERSION, framing
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.priority import to_wire
from crossover.settings import PluginSettings

_log = logging.getLogger(__name__)

__all__ = ["FrameStream", "GrpcStream", "SessionStream", "StreamBroken", "Unreachable", "connect"]

_CLOSE = object()
_MAX_FDS = 4


class Unreachable(CrossoverError):
    """No daemon to attach to, or one that refused this rank: `why`, and what the rank does next (`then`)."""

    def __init__(self, why: str, then: str = "") -> None:
        super().__init__(why)
        self.why, self.then = why, then


def connect(settings: PluginSettings, identity: pb.RankIdentity, channel: grpc.Channel,
            metadata: list[tuple[str, str]]) -> tuple[pb.RegisterResponse, SessionStream]:
    """Register with the daemon at `settings.target` and open the session stream: the session socket when
    the daemon offers it (and the rank did not ask for gRPC), else gRPC. Unreachable says why not."""
    s = settings
    missing = missing_socket(s.target)
    if missing:
        raise Unreachable(f"no daemon socket at {missing}")
    untrusted = untrusted_socket(s.target, s.daemon_user)
    if untrusted:
        raise Unreachable(untrusted, f"checks the socket again every {s.reconnect_interval_s:g} s")
    stub = pb_grpc.SchedulerStub(channel)
    try:
        grpc.channel_ready_future(channel).result(timeout=s.connect_timeout_s)
        reg = stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=identity,
                                               accepts_leases=s.lease, accepts_preempt=True,
                                               accepts_handover=s.handover, priority=to_wire(s.priority)),
                            timeout=s.connect_timeout_s, metadata=metadata)
    except grpc.FutureTimeoutError:
        raise Unreachable(f"no daemon answers at {s.target}") from None
    except grpc.RpcError as exc:
        raise Unreachable(f"daemon at {s.target} refused this rank: {exc.code().name}: {exc.details()}",
                          f"asks again every {s.reconnect_interval_s:g} s") from None
    first = pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id)
    untrusted = untrusted_socket(f"unix://{reg.session_socket}", s.daemon_user) if reg.session_socket else ""
    if untrusted:
        _log.warning("%s; using the gRPC stream", untrusted)
    elif reg.session_socket and s.transport == "auto":
        try:
            return reg, FrameStream(reg.session_socket, first, s.connect_timeout_s)
        except OSError as exc:
            _log.info("session socket %s unusable (%s); using the gRPC stream", reg.session_socket, exc)
    return reg, GrpcStream(stub, metadata, first)


class StreamBroken(CrossoverError):
    """The stream ended other than by the daemon closing it cleanly; the message says why."""


class SessionStream(Protocol):
    name: str

    def send(self, event: pb.RankEvent) -> None:
        """Queue or write one event without blocking; StreamBroken when it cannot go."""

    def close(self) -> None:
        """Half-close: the daemon sees the end after every event already sent."""

    def dispose(self) -> None:
        """Release everything at once (after close, or when the daemon never answers it)."""

    def receive(self) -> Iterator[pb.Directive]:
        """The daemon's directives until it closes the stream; StreamBroken when it breaks."""

    def take_fd(self) -> int | None:
        """The next file descriptor that came with the stream (a `HandoverPage`'s), now the caller's; None: none."""


class GrpcStream:
    """Scheduler.Session: events go through a queue the gRPC runtime drains on its own thread."""

    name = "grpc"

    def __init__(self, stub: pb_grpc.SchedulerStub, metadata: list[tuple[str, str]], first: pb.RankEvent) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(first)
        self._responses = stub.Session(_drain(self._outbox), metadata=metadata)

    def send(self, event: pb.RankEvent) -> None:
        self._outbox.put(event)

    def close(self) -> None:
        self._outbox.put(_CLOSE)

    def dispose(self) -> None:
        self._responses.cancel()

    def receive(self) -> Iterator[pb.Directive]:
        try:
            yield from self._responses
        except grpc.RpcError as exc:
            raise StreamBroken(f"{exc.code().name}: {exc.details()}") from None

    def take_fd(self) -> int | None:
        return None  # gRPC carries no descriptors: the daemon offers no pages on it


class FrameStream:
    """The daemon's session socket: frames written by the caller, read by the receiving thread."""

    name = "session socket"

    def __init__(self, path: str, first: pb.RankEvent, timeout_s: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.settimeout(None)
            sock.sendall(framing.encode(first))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._fds: collections.deque[int] = collections.deque()  # received with frames, not yet taken

    def send(self, event: pb.RankEvent) -> None:
        data = framing.encode(event)
        try:
            # Never wait: a full socket buffer means the daemon stopped reading long ago.
            sent = self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise StreamBroken(f"cannot write to the session socket: {exc}") from None
        if sent != len(data):
            framing.shut(self._sock)  # wakes the receiving thread
            raise StreamBroken("the daemon stopped reading the session socket")

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def dispose(self) -> None:
        framing.shut(self._sock)  # wakes the receiving thread
        self._sock.close()
        while self._fds:
            os.close(self._fds.popleft())

    def take_fd(self) -> int | None:
        return self._fds.popleft() if self._fds else None

    def _recv(self, n: int) -> bytes:
        """`recv` that keeps the descriptors a frame brings (they ride on its first byte), in order."""
        data, fds, flags, _addr = socket.recv_fds(self._sock, n, _MAX_FDS)
        self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:  # a descriptor was dropped (no room for it): later pages would pair wrongly
            raise OSError("a turn page's descriptor was lost (this process is out of file descriptors?)")
        return data

    def receive(self) -> Iterator[pb.Directive]:
        frames = framing.FrameReader(self._recv)
        while True:
            try:
                directive = frames.next_message(pb.Directive)
            except (framing.FrameError, OSError) as exc:
                raise StreamBroken(f"session socket: {exc}") from None
            if directive is None:
                return
            if directive.HasField("error"):
                raise StreamBroken(f"{directive.error.code}: {directive.error.message}")
            yield directive


def _drain(outbox: queue.SimpleQueue) -> Iterator[pb.RankEvent]:
    while True:
        item = outbox.get()
        if item is _CLOSE:
            return
        yield item
