"""Framing of the Session stream on the daemon's session socket.

Each message is a 4-byte big-endian length followed by the encoded protobuf
(RankEvent from the rank, Directive from the daemon). No HTTP/2 and no
per-message thread hand-offs underneath: on a node, a grant's round trip over
it is several times shorter than over the gRPC stream.
"""
from __future__ import annotations

import socket
import struct
from typing import Callable, TypeVar

from crossover.errors import CrossoverError

__all__ = ["HEADER", "MAX_FRAME", "FrameError", "FrameReader", "encode", "frame_length", "shut"]

_M = TypeVar("_M")

HEADER = 4
MAX_FRAME = 1 << 20  # the largest event (a BATCH of a few hundred iterations) is a few KiB
_LEN = struct.Struct(">I")


class FrameError(CrossoverError, ValueError):
    """A frame header that cannot start a valid message, or a stream that ends inside a frame."""


def encode(message: object) -> bytes:
    """The frame carrying one message (anything with SerializeToString)."""
    body = message.SerializeToString()  # type: ignore[attr-defined]
    if len(body) > MAX_FRAME:
        raise FrameError(f"a {len(body)}-byte message exceeds the {MAX_FRAME}-byte frame limit")
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a header announces; FrameError when it is over the limit."""
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise FrameError(f"frame of {n} bytes announced; the limit is {MAX_FRAME}")
    return n


class FrameReader:
    """Cuts a byte stream into frame bodies; `recv(n)` returns up to n bytes, b"" at the end."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        self._recv = recv
        self._buf = bytearray()

    def next(self) -> bytes | None:
        """The next body; None when the stream ends between frames.

        FrameError when it ends inside one or announces one over the limit;
        whatever `recv` raises (OSError) passes through.
        """
        header = self._fill(HEADER)
        if header is None:
            return None
        body = self._fill(frame_length(header))
        if body is None:
            raise FrameError("the stream ended inside a frame")
        return body

    def next_message(self, message_type: Callable[[], _M]) -> _M | None:
        """The next frame parsed as a `message_type` (a protobuf class); None at a clean end.

        FrameError as for `next`, and when the body does not parse as that message.
        """
        body = self.next()
        if body is None:
            return None
        message = message_type()
        try:
            message.ParseFromString(body)  # type: ignore[attr-defined]
        except Exception as exc:  # protobuf's DecodeError
            raise FrameError(f"a frame does not hold a {type(message).__name__}: {exc}") from None
        return message

    def _fill(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            chunk = self._recv(65536)
            if not chunk:
                if self._buf:
                    raise FrameError("the stream ended inside a frame")
                return None
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


def shut(sock: socket.socket) -> None:
    """Shut both directions, waking any thread blocked on the socket; one already gone is fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
