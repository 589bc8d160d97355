"""A rank's side of the emulated device: submit a compute phase and wait for it, say when an allreduce runs."""
from __future__ import annotations

import os
import socket
import threading

from . import SOCKET_ENV

__all__ = ["DeviceClient", "DeviceGone"]


class DeviceGone(RuntimeError):
    """The node's device server closed the connection or never answered: the emulated device is gone."""


class DeviceClient:
    """One context on the node's emulated device (one per process)."""

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
        """Run `seconds` of device work (at full speed) and return when the device has done it."""
        self._send(f"compute {seconds:.9f}\n")
        while b"\n" not in self._buf:
            try:
                data = self._sock.recv(64)
            except OSError as exc:
                raise DeviceGone(f"emulated device {self.path}: {exc}") from exc
            if not data:
                raise DeviceGone(f"emulated device {self.path} closed the connection")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        if line != b"done":
            raise DeviceGone(f"emulated device {self.path} answered {line[:40]!r}")

    def comm(self, active: bool) -> None:
        """This rank's job has an allreduce in flight (True) or no longer has (False)."""
        self._send(f"comm {int(active)}\n")

    def _send(self, line: str) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(line.encode())
        except OSError as exc:
            raise DeviceGone(f"emulated device {self.path}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
