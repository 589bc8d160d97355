"""One node's emulated device: a Unix-socket server that runs `DeviceModel` on the wall clock.

Each connection is one context (one rank's process) with one in-order stream of
operations, like a CUDA stream. Lines it may send:

    compute <seconds>   `submit <seconds>` then `sync`: the server answers `done` when that work is finished
    submit <seconds>    enqueue that much device work (at full speed); no answer
    sync                answer `done` once everything enqueued before it has finished
    wait <id> <ticket>  no later op starts until peer page <id>'s word has reached ticket (cyclic 32-bit,
                        as CUDA compares: `crossover.protos.turn_page.reached`)
    signal <ticket>     when the stream reaches it, store ticket into this context's own page
    page own            with one fd (SCM_RIGHTS, same sendmsg): this context's own page, mapped read-write
    page <id>           with one fd: peer page <id>, which `wait` may name; mapped read-only (the fd may be O_RDONLY)
    comm 1 | comm 0     this rank's job has an allreduce in flight / no longer has
    alloc <bytes>       grow this context's memory pool to that (`memory.MemoryBudget`); answers `ok`, or
                        `oom cap|device <pool> <limit> <free>` when its cap or the device refuses
    limit <bytes>|none  cap this context's pool (torch's per-process memory fraction); no answer
    footprint           answers `footprint <pool> <outside>`, or `footprint none` before its first alloc

`page`, `comm`, `alloc`, `limit` and `footprint` take effect when they arrive; the others are ops of the stream.
A page is 4096 bytes of shared memory (a memfd) whose word is the little-endian
uint32 at offset 0: the emulated form of cuStreamWaitValue32 /
cuStreamWriteValue32 on host-mapped memory, by which one rank's device work
starts right after another's. Ids and tickets are decimal uint32s; a `page`
line for an id already attached replaces (and unmaps) the old page.

Ops run strictly in order: a compute op starts on the model when it reaches the
front and leaves when the model says it is finished; the others leave as soon as
their condition holds. A line that is not one of these, a `page` line without
exactly one fd, a `wait` on an id never attached or a `signal` without an own
page drops the context, as does a closed connection; dropping closes its fds
and pages. A page must stay at least 4096 bytes long: the server reads it
without checking (a peer that shrinks it kills the server with SIGBUS).

The server sleeps until the next context finishes or a line arrives, so it
costs no CPU while ranks compute; while a stream waits on a page, it polls the
pages every 200 µs.

    python -m testbed.device_model.server --socket /run/x/node0.device.sock [--slice-us 1024 --switch-us 40
                                                                          --interference 0.19]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import mmap
import os
import selectors
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from crossover.protos.turn_page import PAGE_BYTES, WORD, reached

from .memory import MemoryBudget
from .model import DeviceModel, DeviceParams

_log = logging.getLogger("testbed.device_model")
_MAX_LINE = 256
_MAX_FDS = 4  # fds one recv takes; more than one on a line drops the context anyway
_POLL_S = 200e-6  # how often pages are read while a stream waits on one
_EPOLL_TICK_S = 1e-3  # epoll's resolution: shorter waits sleep instead
_RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


@dataclass(frozen=True)
class _Op:
    """One op of a context's stream: `work` (seconds of compute), `sync`, `wait` (page, ticket) or `signal`."""

    kind: str
    work_s: float = 0.0
    page: int = 0
    ticket: int = 0


class _Context:
    """One connection: its unparsed input, received fds not yet taken, its pages and its stream."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""
        self.fds: deque[int] = deque()  # arrival order; each `page` line takes the next
        self.own: mmap.mmap | None = None
        self.peers: dict[int, mmap.mmap] = {}
        self.ops: deque[_Op] = deque()
        self.running = False  # the front op is work the model is doing
        self.closed = False

    def release(self) -> None:
        """Close every fd and page this context holds, and forget its stream."""
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())
        for page in [self.own, *self.peers.values()]:
            if page is not None:
                page.close()
        self.own = None
        self.peers.clear()
        self.ops.clear()


def _uint32(word: str) -> int:
    """A page id or ticket: decimal digits only, below 2**32."""
    if not (word.isascii() and word.isdigit()) or len(word) > 10 or int(word) >= 1 << 32:
        raise ValueError(f"{word[:20]!r} is not a decimal uint32")
    return int(word)


def _seconds(word: str) -> float:
    work = float(word)
    if not math.isfinite(work) or work < 0:
        raise ValueError(f"work {work} s is not a finite number ≥ 0")
    return work


def _word(page: mmap.mmap) -> int:
    value: int = WORD.unpack_from(page, 0)[0]
    return value


def _parse_op(words: list[str]) -> list[_Op]:
    """The stream ops one line stands for (compute is two); ValueError when it is none of them."""
    verb, args = (words[0], words[1:]) if words else ("", [])
    if verb in ("compute", "submit") and len(args) == 1:
        work = _Op("work", work_s=_seconds(args[0]))
        return [work, _Op("sync")] if verb == "compute" else [work]
    if verb == "sync" and not args:
        return [_Op("sync")]
    if verb == "wait" and len(args) == 2:
        return [_Op("wait", page=_uint32(args[0]), ticket=_uint32(args[1]))]
    if verb == "signal" and len(args) == 1:
        return [_Op("signal", ticket=_uint32(args[0]))]
    raise ValueError("not a line of the protocol")


class DeviceServer:
    """The loop: accept contexts, read their lines, run their streams, answer `done` when the model says so."""

    def __init__(self, path: Path, params: DeviceParams, memory: MemoryBudget | None = None) -> None:
        self.path = path
        self.model = DeviceModel(params)
        self.memory = memory or MemoryBudget(0)
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.contexts: dict[_Context, None] = {}  # the live ones, in the order they connected
        self.phases = 0  # compute ops received (compute and submit lines)
        self.stopping = False

    def serve(self) -> dict[str, float]:
        """Run until `stopping`; what the device did."""
        started = time.monotonic()
        while not self.stopping:
            for key, _ in self._select(self._timeout()):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            self._step()
        elapsed = time.monotonic() - started
        _log.info("device server %s: %d compute phases; busy %.1f s, shared %.1f s of %.1f s", self.path,
                  self.phases, self.model.busy_s, self.model.shared_s, elapsed)
        return {"phases": self.phases, "busy_s": self.model.busy_s, "shared_s": self.model.shared_s,
                "elapsed_s": elapsed}

    def close(self) -> None:
        """Drop every context (closing its fds and pages) and stop listening."""
        for ctx in list(self.contexts):
            self._drop(ctx)
        self.sel.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _timeout(self) -> float:
        """Until the next finish (1 s at most); 200 µs while a stream waits on a page."""
        due = self.model.next_finish()
        timeout = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
        return min(timeout, _POLL_S) if self._waiting() else timeout

    def _select(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        """`sel.select`, but a wait shorter than epoll's 1 ms tick sleeps rather than rounding up to it."""
        if timeout >= _EPOLL_TICK_S:
            return self.sel.select(timeout)
        events = self.sel.select(0)
        if not events and timeout > 0:
            time.sleep(timeout)
        return events

    def _waiting(self) -> list[_Context]:
        return [ctx for ctx in self.contexts if ctx.ops and ctx.ops[0].kind == "wait"]

    def _step(self) -> None:
        """Move the streams on: past the work the model has finished, past the waits whose page has come."""
        for ctx in self.model.finished(time.monotonic()):
            assert isinstance(ctx, _Context)
            ctx.running = False
            ctx.ops.popleft()
            self._advance(ctx)
        for ctx in self._waiting():
            self._advance(ctx)

    def _advance(self, ctx: _Context) -> None:
        """Run `ctx`'s stream from the front until an op must wait: work still running, or a page short of its
        ticket."""
        while ctx.ops and not ctx.closed:
            op = ctx.ops[0]
            if op.kind == "work":
                if not ctx.running:
                    self.model.submit(ctx, op.work_s, time.monotonic())
                    ctx.running = True
                return
            if op.kind == "wait" and not reached(_word(ctx.peers[op.page]), op.ticket):
                return
            if op.kind == "signal" and ctx.own is not None:
                WORD.pack_into(ctx.own, 0, op.ticket)
            ctx.ops.popleft()
            if op.kind == "sync":
                self._send(ctx, b"done\n")

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        ctx = _Context(conn)
        self.contexts[ctx] = None
        self.sel.register(conn, selectors.EVENT_READ, ctx)

    def _drop(self, ctx: _Context, why: str = "") -> None:
        """Forget `ctx`: its work, its connection, its fds and pages (once; later calls do nothing)."""
        if ctx.closed:
            return
        if why:
            _log.warning("dropping a context: %s", why)
        ctx.closed = True
        self.contexts.pop(ctx, None)
        self.model.remove(ctx, time.monotonic())
        self.memory.remove(ctx)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(ctx.conn)
        ctx.conn.close()
        ctx.release()

    def _send(self, ctx: _Context, data: bytes) -> None:
        try:
            ctx.conn.sendall(data)
        except OSError:
            self._drop(ctx)

    def _read(self, ctx: _Context) -> None:
        """Take what `ctx` sent (with any fds) and handle its complete lines."""
        try:
            data, fds, flags, _ = socket.recv_fds(ctx.conn, 4096, _MAX_FDS, _RECV_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds, flags = b"", [], 0
        ctx.fds.extend(fds)
        if not data:
            self._drop(ctx)
            return
        if len(fds) > 1 or flags & socket.MSG_CTRUNC:
            self._drop(ctx, f"{len(fds)} fds on one line")
            return
        ctx.buf += data
        while b"\n" in ctx.buf and not ctx.closed:
            line, ctx.buf = ctx.buf.split(b"\n", 1)
            self._handle(ctx, line.decode(errors="replace").split())
        if ctx.closed:
            return
        if len(ctx.buf) > _MAX_LINE:
            self._drop(ctx, f"a line over {_MAX_LINE} bytes")
        elif ctx.fds and not ctx.buf:
            self._drop(ctx, "an fd on a line that is not `page`")

    def _handle(self, ctx: _Context, words: list[str]) -> None:
        """One line: a page or comm now, or ops onto the stream; drops the context when the line is bad."""
        try:
            if words[:1] == ["page"] and len(words) == 2:
                self._attach(ctx, words[1])
                return
            if words[:1] == ["comm"] and len(words) == 2 and words[1] in ("0", "1"):
                self.model.set_comm(ctx, words[1] == "1", time.monotonic())
                return
            if words[:1] in (["alloc"], ["limit"], ["footprint"]):
                self._memory_line(ctx, words)
                return
            ops = _parse_op(words)
            self._check(ctx, ops)
        except (ValueError, OSError) as exc:
            self._drop(ctx, f"it sent {' '.join(words)[:80]!r}: {exc}")
            return
        ctx.ops.extend(ops)
        self.phases += sum(op.kind == "work" for op in ops)
        self._advance(ctx)

    def _memory_line(self, ctx: _Context, words: list[str]) -> None:
        if words == ["footprint"]:
            held = self.memory.footprint(ctx)
            self._send(ctx, b"footprint none\n" if held is None else f"footprint {held[0]} {held[1]}\n".encode())
        elif words[0] == "alloc" and len(words) == 2 and words[1].isdigit():
            refused = self.memory.grow(ctx, int(words[1]))
            self._send(ctx, b"ok\n" if refused is None else
                       f"oom {refused.reason} {refused.pool} {refused.limit} {refused.free}\n".encode())
        elif words[0] == "limit" and len(words) == 2 and (words[1].isdigit() or words[1] == "none"):
            self.memory.set_limit(ctx, None if words[1] == "none" else int(words[1]))
        else:
            raise ValueError("not a memory line")

    @staticmethod
    def _check(ctx: _Context, ops: list[_Op]) -> None:
        """A wait needs its page attached, a signal an own page: checked when the line arrives."""
        for op in ops:
            if op.kind == "wait" and op.page not in ctx.peers:
                raise ValueError(f"page {op.page} was never attached")
            if op.kind == "signal" and ctx.own is None:
                raise ValueError("no own page to signal in")

    @staticmethod
    def _attach(ctx: _Context, which: str) -> None:
        """Map the next received fd as the own page (`own`, read-write) or as peer page `which` (read-only)."""
        page = None if which == "own" else _uint32(which)
        if not ctx.fds:
            raise ValueError("no fd came with it")
        fd = ctx.fds.popleft()
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if page is None else 0)
            mapped = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        if page is None:
            old, ctx.own = ctx.own, mapped
        else:
            old, ctx.peers[page] = ctx.peers.get(page), mapped
        if old is not None:
            old.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", type=Path, required=True, help="Unix socket to serve on (replaced if it exists)")
    defaults = DeviceParams()
    p.add_argument("--slice-us", type=float, default=defaults.slice_us, help="time slice per context (µs)")
    p.add_argument("--switch-us", type=float, default=defaults.switch_us, help="cost of one context switch (µs)")
    p.add_argument("--interference", type=float, default=defaults.interference,
                   help="compute slowdown while an allreduce is in flight (0.19: 19%% slower)")
    p.add_argument("--memory-mb", type=int, default=0, help="the device's memory (MiB; 0: not modelled)")
    p.add_argument("--context-mb", type=int, default=300,
                   help="what each context holds outside its allocator pool once it allocates (MiB)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        params = DeviceParams(args.slice_us, args.switch_us, args.interference)
        server = DeviceServer(args.socket, params, MemoryBudget(args.memory_mb << 20, args.context_mb << 20))
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
