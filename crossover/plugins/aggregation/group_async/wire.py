"""The parameter service's wire format: one frame is a JSON header and an optional payload of raw bytes.

A frame on the TCP stream: 4 bytes (big-endian) of header length, the
header (UTF-8 JSON, holding ``"bytes"``: the payload length), then the
payload. Tensors travel as the payload in one piece (see :mod:`.codec`), so
nothing is converted element by element.
"""
from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

from crossover.errors import CrossoverError

__all__ = ["MAX_HEADER", "Payload", "WireError", "fill", "node_identity", "recv_frame", "send_frame"]

MAX_HEADER = 1 << 20
_LEN = struct.Struct(">I")

Payload = Union[bytearray, memoryview]
"""A frame's payload as received: fresh memory, or a view of a buffer the receiver keeps (`recv_frame`'s `into`)."""


class WireError(CrossoverError, ConnectionError):
    """The peer closed the connection or sent something that is not a frame."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    head = json.dumps({**header, "bytes": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    if payload:
        sock.sendall(payload)


def fill(sock: socket.socket, view: memoryview) -> None:
    """Receive exactly ``len(view)`` bytes into ``view`` (``WireError`` if the peer closes first)."""
    got, n = 0, len(view)
    while got < n:
        chunk = sock.recv_into(view[got:], n - got)
        if chunk == 0:
            raise WireError("the peer closed the connection")
        got += chunk


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    fill(sock, memoryview(buf))
    return buf


def recv_frame(sock: socket.socket,
               into: Callable[[int], memoryview] | None = None) -> tuple[dict[str, Any], Payload]:
    """The next frame's header and payload. `into(n)`, when given, returns a writable view of `n` bytes the
    payload lands in: a buffer the receiver keeps from frame to frame, because a model's payload in fresh
    memory costs more in page faults than the copy into it (measured: 40 MB in 53 ms fresh, 35 ms reused)."""
    (length,) = _LEN.unpack(_exactly(sock, _LEN.size))
    if length > MAX_HEADER:
        raise WireError(f"a frame header of {length} bytes is not ours")
    try:
        header = json.loads(bytes(_exactly(sock, length)))
    except ValueError as exc:
        raise WireError(f"a frame header that is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("bytes"), int) or header["bytes"] < 0:
        raise WireError("a frame header without its payload length")
    n = header["bytes"]
    if not n:
        return header, bytearray()
    if into is None:
        return header, _exactly(sock, n)
    view = into(n)
    fill(sock, view)
    return header, view


def node_identity() -> dict[str, Any]:
    """What a leader and the service compare to know they may share memory: the same kernel boot and
    network namespace (an emulated cluster's nodes share a filesystem, not a network namespace)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return {}
    return {"boot": boot, "netns": netns}
