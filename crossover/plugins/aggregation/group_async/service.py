"""The parameter service: the global model that group leaders push their updates to and pull from.

One process per job, started by the job's rank 0 (and restarted by it if it
dies), listening on TCP. Why a process the job starts rather than a
``crossoverd`` role: the model belongs to the job, lives and dies with it,
needs no trust between jobs, and costs the node daemon no memory; and as a
separate process it holds its own GIL, so rank 0's training and the service's
tensor adds do not take turns.

Every exchange adds the group's update to the global model, ticks the
group's SSP clock (:mod:`.clock`), and answers with the global model once the
group is within the staleness bound of the slowest active group. With
``--state-dir``, the model, its version, the clocks and the last applied
exchange of every group are written (atomically) before the answer, so a
restarted service resumes from the newest model and loses no acknowledged
update; an exchange a leader retries after losing the answer is recognised
by its sequence number and not applied twice. The model lives there in two
memory-mapped files used in turn (the add writes the spare, then the small
JSON record names it), so keeping it costs one pass of the add, not a
file write per exchange; rank 0 puts a job's state in ``/dev/shm``.

A leader on the same node hands the service three shared-memory buffers
(``slots``, see :mod:`.link`): its updates and the answers then move
through them, and the TCP stream carries only headers.

Run by hand: ``python -m crossover.plugins.aggregation.group_async.service --port 7070
--bound 4 --state-dir /var/tmp/job --token-file token``.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import shutil
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from crossover.plugins.aggregation.group_async.codec import decode, encode_answer
from crossover.plugins.aggregation.group_async.global_model import GlobalModel
from crossover.plugins.aggregation.group_async.passes import Passes, default_threads
from crossover.plugins.aggregation.group_async.schedule import SCHEDULES, Schedule
from crossover.plugins.aggregation.group_async.shared_buffers import map_described
from crossover.plugins.aggregation.group_async.wire import Payload, WireError, recv_frame, send_frame

__all__ = ["GlobalModel", "ParameterService", "main"]

_log = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: ParameterService
    slots: tuple[np.ndarray, ...] = ()  # this connection's leader's shared buffers, once it offered them
    # What this connection's leader holds of the global model, as far as the answers sent it (fp16, topk)
    held: Optional[np.ndarray] = None
    # The buffers this connection's payloads land in and its answers leave from, kept from one exchange to
    # the next: a model's worth of fresh memory per frame costs more in page faults than the copy into it.
    inbox: Optional[np.ndarray] = None
    outbox: Optional[np.ndarray] = None
    half: Optional[np.ndarray] = None  # fp16 answers: the difference cast to half precision
    wide: Optional[np.ndarray] = None  # fp16 updates: widened to float32 before they are added

    def _wide(self, numel: int) -> np.ndarray:
        if self.wide is None or self.wide.size != numel:
            self.wide = np.empty(numel, dtype=np.float32)
        return self.wide

    def _receive_into(self, n: int) -> memoryview:
        if self.inbox is None or self.inbox.size < n:
            self.inbox = np.empty(n, dtype=np.uint8)
        return self.inbox.data[:n]

    def _answer(self, state: GlobalModel, into: Optional[np.ndarray]) -> bytes | memoryview:
        """The global model: into the leader's shared buffer when it gave one (nothing then travels), else
        copied into this connection's outbox and sent from there."""
        if into is not None:
            return state.snapshot(into=into)
        return self._copy(state).data.cast("B")

    def _copy(self, state: GlobalModel) -> np.ndarray:
        """The global model, copied into this connection's outbox (kept from one answer to the next)."""
        numel = state.numel
        if self.outbox is None or self.outbox.size != numel:
            self.outbox = np.empty(numel, dtype=np.float32)
        state.snapshot(into=self.outbox)
        return self.outbox

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = self.server.state
        try:
            header, _ = recv_frame(sock)
            if header.get("op") != "auth" or not hmac.compare_digest(str(header.get("token", "")),
                                                                      self.server.token):
                send_frame(sock, {"error": "unauthenticated: a wrong or missing token"})
                return
            send_frame(sock, {"ok": True})
            while True:
                header, payload = recv_frame(sock, self._receive_into)
                try:
                    reply, body = self._one(state, header, payload)
                except (ValueError, KeyError, TypeError, OSError) as exc:
                    reply, body = {"error": str(exc)}, b""
                send_frame(sock, reply, body)
        except (WireError, OSError):
            return

    def _slot(self, header: dict[str, Any], key: str) -> Optional[np.ndarray]:
        if key not in header:
            return None
        if not self.slots:
            raise ValueError("no shared buffers on this connection: send `slots` first")
        return self.slots[int(header[key])]

    def _difference(self, state: GlobalModel, reply: dict[str, Any], kind: str,
                    fraction: float) -> tuple[dict[str, Any], bytes | memoryview]:
        """The answer to a leader that pushes with a lossy codec: the whole model the first time on a
        connection, then only how the model differs from what the leader holds, in the same codec."""
        numel = state.numel
        if self.held is None or self.held.size != numel:
            model = self._copy(state)
            self.held = model.copy()
            return {**reply, "answer": "full"}, model.data.cast("B")
        if self.outbox is None or self.outbox.size != numel:
            self.outbox = np.empty(numel, dtype=np.float32)
        delta = state.difference(self.held, out=self.outbox)
        if kind != "fp16":
            body = encode_answer(kind, delta, fraction)
            state.passes.add(self.held, decode(kind, body, numel), out=self.held)
            return {**reply, "answer": kind}, body
        if self.half is None or self.half.size != numel:
            self.half = np.empty(numel, dtype=np.float16)
        body = encode_answer(kind, delta, fraction, self.half)
        state.passes.add(self.held, decode(kind, body, numel, out=self._wide(numel)), out=self.held)
        return {**reply, "answer": kind}, body

    def _one(self, state: GlobalModel, header: dict[str, Any],
             payload: Payload) -> tuple[dict[str, Any], bytes | memoryview]:
        op = header["op"]
        if op == "hello":
            return state.hello(int(header["group"]), bytes(payload), int(header["numel"])), b""
        if op == "slots":
            self.slots = tuple(map_described(list(header["slots"]), int(header["numel"])))
            return {"ok": True}, b""
        if op == "exchange":
            numel = int(header["numel"])
            update = self._slot(header, "slot")
            if update is None:
                kind = str(header["codec"])
                update = decode(kind, payload, numel, out=self._wide(numel) if kind == "fp16" else None)
            reply = state.exchange(int(header["group"]), int(header["seq"]), update, bool(header.get("wait", True)),
                                   int(header.get("epoch", -1)), int(header.get("taken", 0)),
                                   int(header.get("ticks", 1)), float(header.get("cost_s", 0.0)))
            answer = self._slot(header, "answer")
            if reply["duplicate"]:  # the leader discards it: its held model must not move either
                return reply, b""
            if answer is None and header["codec"] in ("fp16", "topk"):
                return self._difference(state, reply, str(header["codec"]), float(header.get("fraction", 0.01)))
            return reply, self._answer(state, answer)
        if op == "progress":
            return state.progress(int(header["group"]), int(header["epoch"]), int(header["taken"])), b""
        if op == "park":
            state.park(int(header["group"]))
            return {"ok": True}, b""
        if op == "pull":
            if header.get("level"):
                state.level()
            return {"version": state.version}, self._answer(state, self._slot(header, "answer"))
        if op == "regroup":
            state.regroup([int(g) for g in header["leaders"]])
            return {"ok": True}, b""
        if op == "stats":
            return state.stats(), b""
        raise ValueError(f"unknown operation {op!r}")


class ParameterService(socketserver.ThreadingTCPServer):
    """The TCP server around one :class:`GlobalModel`; every connection must first send the job's token."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: GlobalModel, token: str) -> None:
        super().__init__(address, _Handler)
        self.state = state
        self.token = token


def _exit_with(parent: int, server: ParameterService, remove: Optional[Path]) -> None:
    """A service whose rank 0 is gone has nobody to serve: stop (a job killed hard leaves no orphan),
    and remove the job's temporary state, which nobody will resume from."""
    while os.getppid() == parent:
        time.sleep(1.0)
    _log.warning("rank 0 (pid %d) is gone; stopping", parent)
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)
    server.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m crossover.plugins.aggregation.group_async.service",
                                description="The parameter service of one group_async job (rank 0 starts it).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other nodes' leaders)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (written to --port-file)")
    p.add_argument("--bound", type=int, default=4, help="SSP staleness bound, in exchanges")
    p.add_argument("--schedule", choices=SCHEDULES, default="fixed",
                   help="staged: price 8 exchanges at --period and --bound; where they are dear, a coarse stage "
                        "(4x the period, 2x the bound) until the global model's rate of change flattens; then the "
                        "fine one (--period, --bound); each answer names the stage")
    p.add_argument("--period", type=float, default=0.5, help="the leaders' exchange period in seconds (the staged "
                   "schedule's fine stage; its windows of observation are 16 periods)")
    p.add_argument("--state-dir", default="", help="write the global model here after every exchange and "
                   "resume from it at start")
    p.add_argument("--token-file", required=True, help="file holding the job's token")
    p.add_argument("--port-file", default="", help="write the port listened on here once listening")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (rank 0) is gone")
    p.add_argument("--remove-state-with-parent", action="store_true",
                   help="the state directory is the job's temporary one: remove it when --parent-pid is gone")
    p.add_argument("--start-version", type=int, default=0,
                   help="the first model's version when --state-dir holds none (a run resumed from a checkpoint)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="threads for the adds and copies of the model (default: this node's cores, at most 4); the "
                        "group being answered waits meanwhile, so they are mostly its own cores")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, not {args.threads}")
    # fp16's casts load torch here (`codec.cast`), with as many threads as the passes.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s param-service %(levelname)s %(message)s")
    token = Path(args.token_file).read_text().strip()
    state = GlobalModel(args.bound, Path(args.state_dir) if args.state_dir else None,
                        start_version=args.start_version, schedule=Schedule(args.schedule, args.period, args.bound),
                        passes=Passes(args.threads))
    with ParameterService((args.host, args.port), state, token) as server:
        port = server.server_address[1]
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            os.replace(tmp, args.port_file)
        _log.info("listening on %s:%d (%s schedule, bound %d, %d threads, pid %d)", args.host, port, args.schedule,
                  state.clock.bound, args.threads, os.getpid())
        if args.parent_pid:
            remove = Path(args.state_dir) if args.remove_state_with_parent and args.state_dir else None
            threading.Thread(target=_exit_with, args=(args.parent_pid, server, remove), daemon=True).start()
        server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
