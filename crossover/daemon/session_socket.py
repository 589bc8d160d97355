"""The session socket: a rank's session stream as length-prefixed frames on a Unix socket.

It exists because a grant's round trip through gRPC Python costs about 0.5 ms
on a small VM before the daemon does anything, while frames on a Unix socket,
read by a thread per rank, cost a fraction of that. The lifecycle is
`session_stream.SessionLifecycle`, shared with the gRPC stream.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import NamedTuple

from crossover.daemon.api import CrossoverError, InvalidRequest
from crossover.daemon.limits import Connections, StreamLimits
from crossover.daemon.messages import CloseMsg, Message, PageMsg
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.session_stream import SessionLifecycle, directive, refusal, too_many
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import framing

__all__ = ["SessionSocketServer"]

_log = logging.getLogger(__name__)


class Peer(NamedTuple):
    """Who is at the other end of a session socket connection, as the kernel says (SO_PEERCRED).

    `pid` is 0 when the peer runs in a process namespace the daemon cannot see (a container)."""

    pid: int
    uid: int
    gid: int


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid)


class _FrameTooSlow(BlockingIOError):
    """A frame began but did not arrive whole in time."""


class _FrameClock:
    """`recv` for a `FrameReader` with a deadline on each whole frame.

    Between frames a read waits as long as the connection's standing timeout (the
    OPEN or idle limit); once a frame has begun, the rest must arrive within
    `frame_timeout_s`, however its bytes trickle in. Without this a client could
    announce a large frame and send a byte every few seconds, holding a thread,
    a slot and the buffer for as long as it liked.
    """

    def __init__(self, conn: socket.socket, frame_timeout_s: float) -> None:
        self._conn = conn
        self._frame_timeout_s = frame_timeout_s
        self._standing = 0.0
        self._deadline: float | None = None
        self._shortened = False

    def wait_between_frames(self, seconds: float) -> None:
        self._standing = seconds
        _receive_timeout(self._conn, seconds)

    def frame_done(self) -> None:
        self._deadline = None
        if self._shortened:
            _receive_timeout(self._conn, self._standing)
            self._shortened = False

    def recv(self, n: int) -> bytes:
        if self._deadline is None:
            data = self._conn.recv(n)
            if data:
                self._deadline = time.monotonic() + self._frame_timeout_s
            return data
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _FrameTooSlow(f"a frame did not arrive whole within {self._frame_timeout_s:g} s")
        _receive_timeout(self._conn, left)
        self._shortened = True
        try:
            return self._conn.recv(n)
        except BlockingIOError:
            raise _FrameTooSlow(f"a frame did not arrive whole within {self._frame_timeout_s:g} s") from None


class _FrameConnection:
    """One rank on the session socket, served by its own thread.

    A thread blocked in recv wakes sooner than an event loop blocked in epoll
    (measured on a 2-vCPU VM after 50 ms idle: 0.22 vs 0.40-0.49 ms per round
    trip), and grants are written straight from whichever thread decides them.
    Writes never wait: a rank whose socket buffer is full stopped reading long
    ago, and its connection is dropped rather than let it stall the scheduler.
    A connection that does not OPEN in time, then falls silent, or sends a frame
    slower than `StreamLimits.frame_timeout_s`, is closed, so no thread waits
    forever on a client that left half-way or trickles bytes on purpose. The
    session is bound to the peer's process and user as the kernel reports them.
    """

    def __init__(self, core: Scheduler, conn: socket.socket, limits: StreamLimits, peer: Peer | None = None) -> None:
        self._core = core
        self._conn = conn
        self._limits = limits
        self._peer = peer
        self._write_lock = threading.Lock()
        self._clock = _FrameClock(conn, limits.frame_timeout_s)
        self._frames = framing.FrameReader(self._clock.recv)

    def serve(self) -> None:
        life = SessionLifecycle(self._core, self._limits)
        try:
            self._clock.wait_between_frames(self._limits.open_timeout_s)
            first = self._read()
            if first is None:
                return
            life.open(first, self._deliver, passes_fds=True)
            if self._peer is not None and life.sid:
                self._core.bind_peer(life.sid, self._peer.pid, self._peer.uid, self._peer.gid)
            self._clock.wait_between_frames(self._limits.idle_timeout_s)
            while (ev := self._read()) is not None:
                life.receive(ev)
        except CrossoverError as exc:
            life.refused(exc)
            self._fail(exc)
        except _FrameTooSlow as exc:
            life.reason = "frame too slow"
            self._fail(InvalidRequest(str(exc)))
        except BlockingIOError:  # the receive timeout
            life.reason = "stream silent"
            self._fail(InvalidRequest("no OPEN in time" if not life.sid else "no event in time"))
        except OSError:  # the peer vanished mid-read (process killed, connection reset)
            life.reason = "stream broken"
        finally:
            life.close()
            self._drop()
            self._conn.close()

    def _read(self) -> pb.RankEvent | None:
        """The next event; None at a clean end. InvalidRequest on a malformed frame."""
        try:
            return self._frames.next_message(pb.RankEvent)
        except framing.FrameError as exc:
            raise InvalidRequest(str(exc)) from None
        finally:
            self._clock.frame_done()

    def _deliver(self, msg: Message) -> None:  # from any thread, never blocking (the scheduler's contract)
        if isinstance(msg, CloseMsg):
            if msg.error is not None:
                self._fail(msg.error)
            self._drop()
            return
        out = directive(msg)
        fds = [msg.fd] if isinstance(msg, PageMsg) else []
        if out is not None and not self._write(framing.encode(out), fds):
            self._drop()

    def _write(self, data: bytes, fds: list[int] | None = None) -> bool:
        """Send one whole frame without waiting (`fds` ride on its first byte); False: the rank is gone
        or stopped reading."""
        with self._write_lock:
            try:
                sent = (socket.send_fds(self._conn, [data], fds, socket.MSG_DONTWAIT) if fds
                        else self._conn.send(data, socket.MSG_DONTWAIT))
                if sent == len(data):
                    return True
            except BlockingIOError:
                pass
            except OSError:  # the peer is gone: its reading thread sees the end too
                return False
            _log.warning("dropping a rank's session: it stopped reading the session socket")
            return False

    def _fail(self, exc: Exception) -> None:
        code, text = refusal(exc)
        self._write(framing.encode(pb.Directive(error=pb.SessionError(code=code.name, message=text))))

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
        self._refusals = _Refusals()

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
            try:
                peer: Peer | None = peer_of(conn)
            except OSError:
                peer = None
            uid = peer.uid if peer is not None else None
            if not self._connections.enter(uid):
                self._refusals.note(uid, self._connections)
                _FrameConnection(self._core, conn, self._limits)._fail(too_many(self._connections, uid))
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, peer), name="session-conn", daemon=True).start()
            except RuntimeError as exc:  # no thread to spare: refuse this one, keep accepting
                _log.error("cannot serve a session socket connection (%s); refusing it", exc)
                with self._lock:
                    self._conns.discard(conn)
                self._connections.leave(uid)
                conn.close()
                time.sleep(0.05)

    def _serve(self, conn: socket.socket, peer: Peer | None) -> None:
        try:
            _FrameConnection(self._core, conn, self._limits, peer).serve()
        except Exception:  # a bug here must not take the daemon down
            _log.exception("session socket connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._connections.leave(peer.uid if peer is not None else None)


class _Refusals:
    """Refused connections, logged at most once every `every_s` with a count, not one line each:
    a client that retries in a loop must not flood the daemon's log."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every_s = every_s
        self._last = -every_s
        self._since = 0
        self._lock = threading.Lock()

    def note(self, uid: int | None, connections: Connections) -> None:
        with self._lock:
            self._since += 1
            now = time.monotonic()
            if now - self._last < self._every_s:
                return
            n, self._since, self._last = self._since, 0, now
        _log.warning("refused %d session socket connection(s) in the last %.0f s (latest from uid %s): %d streams "
                     "open of %d, %d per user at most", n, self._every_s, uid, connections.count, connections.cap,
                     connections.per_uid)
