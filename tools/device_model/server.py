"""One node's emulated device: a Unix-socket server that runs `DeviceModel` on the wall clock.

Each connection is one context (one rank's process). Lines it may send:

    compute <seconds>   start that much device work; the server answers `done` when it is finished
    comm 1 | comm 0     this rank's job has an allreduce in flight / no longer has

A closed connection drops its context. The server sleeps until the next
context finishes or a line arrives, so it costs no CPU while ranks compute.

    python -m tools.device_model.server --socket /run/x/node0.device.sock [--slice-us 1024 --switch-us 40
                                                                          --interference 0.19]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType

from .model import DeviceModel, DeviceParams

_log = logging.getLogger("tools.device_model")
_MAX_LINE = 256


class _Context:
    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""


class DeviceServer:
    """The loop: accept contexts, read their lines, answer `done` when the model says so."""

    def __init__(self, path: Path, params: DeviceParams) -> None:
        self.path = path
        self.model = DeviceModel(params)
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.phases = 0
        self.stopping = False

    def serve(self) -> dict[str, float]:
        """Run until `stopping`; what the device did."""
        started = time.monotonic()
        while not self.stopping:
            due = self.model.next_finish()
            timeout = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            for ctx in self.model.finished(time.monotonic()):
                self._send(ctx, b"done\n")
        elapsed = time.monotonic() - started
        _log.info("device server %s: %d compute phases; busy %.1f s, shared %.1f s of %.1f s", self.path,
                  self.phases, self.model.busy_s, self.model.shared_s, elapsed)
        return {"phases": self.phases, "busy_s": self.model.busy_s, "shared_s": self.model.shared_s,
                "elapsed_s": elapsed}

    def close(self) -> None:
        self.sel.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ, _Context(conn))

    def _drop(self, ctx: _Context) -> None:
        self.model.remove(ctx, time.monotonic())
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(ctx.conn)
        ctx.conn.close()

    def _send(self, ctx: object, data: bytes) -> None:
        assert isinstance(ctx, _Context)
        try:
            ctx.conn.sendall(data)
        except OSError:
            self._drop(ctx)

    def _read(self, ctx: _Context) -> None:
        try:
            data = ctx.conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(ctx)
            return
        ctx.buf += data
        while b"\n" in ctx.buf:
            line, ctx.buf = ctx.buf.split(b"\n", 1)
            if not self._handle(ctx, line.decode(errors="replace").split()):
                self._drop(ctx)
                return
        if len(ctx.buf) > _MAX_LINE:
            self._drop(ctx)

    def _handle(self, ctx: _Context, words: list[str]) -> bool:
        now = time.monotonic()
        try:
            if len(words) == 2 and words[0] == "compute":
                self.model.submit(ctx, float(words[1]), now)
                self.phases += 1
                return True
            if len(words) == 2 and words[0] == "comm" and words[1] in ("0", "1"):
                self.model.set_comm(ctx, words[1] == "1", now)
                return True
        except ValueError as exc:
            _log.warning("dropping a context: %s", exc)
            return False
        _log.warning("dropping a context that sent %r", " ".join(words)[:80])
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", type=Path, required=True, help="Unix socket to serve on (replaced if it exists)")
    defaults = DeviceParams()
    p.add_argument("--slice-us", type=float, default=defaults.slice_us, help="time slice per context (µs)")
    p.add_argument("--switch-us", type=float, default=defaults.switch_us, help="cost of one context switch (µs)")
    p.add_argument("--interference", type=float, default=defaults.interference,
                   help="compute slowdown while an allreduce is in flight (0.19: 19%% slower)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        params = DeviceParams(args.slice_us, args.switch_us, args.interference)
        server = DeviceServer(args.socket, params)
    except (ValueError, OSError) as exc:
        print(f"device server: {exc}", file=sys.stderr)
        return 2

    def stop(_sig: int, _frame: FrameType | None) -> None:
        server.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    _log.info("device server on %s (pid %d): %s", args.socket, os.getpid(), params.describe())
    try:
        print(json.dumps(server.serve()), flush=True)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
