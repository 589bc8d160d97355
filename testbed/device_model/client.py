"""A rank's side of the emulated device: its stream of work, page waits and signals, and its allreduces.

`compute` is the old, blocking form (`submit` then `sync`); `submit`, `wait`,
`signal` and `attach_page` only enqueue or attach and return at once
(`server` lists the lines).
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence

from . import SOCKET_ENV

__all__ = ["DeviceClient", "DeviceGone"]


class DeviceGone(RuntimeError):
    """The node's device server closed the connection or never answered: the emulated device is gone."""


def _uint32(what: str, value: int) -> int:
    if not 0 <= value < 1 << 32:
        raise ValueError(f"{what} {value} is not a uint32")
    return value


class DeviceClient:
    """One context on the node's emulated device (one per process), with one in-order stream."""

    def __init__(self, path: str, timeout_s: float = 600.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DeviceGone(f"no emulated device on {path}: {exc}") from exc
        self._buf = b""
        self._send_lock = threading.Lock()  # `comm` may come from another thread than `compute`

    @classmethod
    def from_env(cls) -> DeviceClient | None:
        """The node's device when the emulated cluster set one (`EMULATED_DEVICE_SOCKET`), else None."""
        path = os.environ.get(SOCKET_ENV, "")
        return cls(path) if path else None

    def compute(self, seconds: float) -> None:
        """Run `seconds` of device work (at full speed) and return when the device has done it (and all before)."""
        self._send(f"compute {seconds:.9f}\n")
        self._await_done()

    def submit(self, seconds: float) -> None:
        """Enqueue `seconds` of device work (at full speed) on the stream; returns at once."""
        self._send(f"submit {seconds:.9f}\n")

    def sync(self) -> None:
        """Return when everything enqueued so far has finished."""
        self._send("sync\n")
        self._await_done()

    def attach_page(self, fd: int, page: int | None) -> None:
        """Give the device a shared-memory page: this context's own (`page` None; `fd` read-write) or peer page
        `page`, which `wait` may name (`fd` may be read-only). The fd stays the caller's: the kernel passes a
        duplicate."""
        line = "page own\n" if page is None else f"page {_uint32('page', page)}\n"
        self._send(line, fds=[fd])

    def wait(self, page: int, ticket: int) -> None:
        """Work enqueued after this starts once peer page `page`'s word has reached `ticket` (cyclic, as the GPU
        compares: `crossover.protos.turn_page.reached`); returns at once."""
        self._send(f"wait {_uint32('page', page)} {_uint32('ticket', ticket)}\n")

    def signal(self, ticket: int) -> None:
        """After the work enqueued so far, the device stores `ticket` in the own page; returns at once."""
        self._send(f"signal {_uint32('ticket', ticket)}\n")

    def comm(self, active: bool) -> None:
        """This rank's job has an allreduce in flight (True) or no longer has (False)."""
        self._send(f"comm {int(active)}\n")

    def alloc(self, pool_bytes: int) -> list[str]:
        """Grow this context's memory pool to `pool_bytes`; [] when done, else the refusal's words
        (`cap|device pool limit free`)."""
        self._send(f"alloc {int(pool_bytes)}\n")
        words = self._await_line().split()
        return [] if words == ["ok"] else words[1:]

    def limit(self, pool_bytes: int | None) -> None:
        """Cap this context's pool (None: no cap); returns at once."""
        self._send(f"limit {'none' if pool_bytes is None else int(pool_bytes)}\n")

    def footprint(self) -> tuple[int, int] | None:
        """(pool, outside) this context holds; None before its first allocation."""
        self._send("footprint\n")
        words = self._await_line().split()
        return None if words[1:] == ["none"] else (int(words[1]), int(words[2]))

    def _await_done(self) -> None:
        line = self._await_line()
        if line != "done":
            raise DeviceGone(f"emulated device {self.path} answered {line[:40]!r}")

    def _await_line(self) -> str:
        while b"\n" not in self._buf:
            try:
                data = self._sock.recv(64)
            except OSError as exc:
                raise DeviceGone(f"emulated device {self.path}: {exc}") from exc
            if not data:
                raise DeviceGone(f"emulated device {self.path} closed the connection")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def _send(self, line: str, fds: Sequence[int] = ()) -> None:
        """One line, with `fds` on the same sendmsg as its first byte."""
        data = line.encode()
        try:
            with self._send_lock:
                if fds:
                    data = data[socket.send_fds(self._sock, [data], list(fds)):]
                if data:
                    self._sock.sendall(data)
        except OSError as exc:
            raise DeviceGone(f"emulated device {self.path}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
