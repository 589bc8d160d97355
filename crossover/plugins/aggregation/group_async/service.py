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
import json
import logging
import mmap
import os
import shutil
import socket
import socketserver
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import numpy as np

from crossover.plugins.aggregation.group_async.clock import SSPClock
from crossover.plugins.aggregation.group_async.codec import decode, encode_answer
from crossover.plugins.aggregation.group_async.wire import WireError, node_identity, recv_frame, send_frame

__all__ = ["GlobalModel", "ParameterService", "main"]

_log = logging.getLogger(__name__)


class GlobalModel:
    """The global model, its version, the SSP clocks and what the service has measured; thread-safe."""

    def __init__(self, bound: int, state_dir: Path | None = None, silent_after_s: float = 30.0,
                 wait_limit_s: float = 120.0, start_version: int = 0) -> None:
        self.clock = SSPClock(bound)
        self.state_dir = state_dir
        self.silent_after_s = silent_after_s
        self.wait_limit_s = wait_limit_s
        self.model: np.ndarray | None = None
        self.version = start_version  # a run resumed from a checkpoint counts on; a saved state wins
        self.start_version = start_version
        self.last_seq: dict[int, int] = {}
        self.last_seen: dict[int, float] = {}
        self.gaps: Counter[int] = Counter()
        self.waits_s: list[float] = []
        self.taken: dict[int, dict[int, int]] = {}  # samples taken by epoch and group (running totals)
        self.resumed_from: int | None = None
        self._current = self._FILES[0]
        self._spare: np.ndarray | None = None
        self._cond = threading.Condition()
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    # ---- persistence ---------------------------------------------------

    _FILES = ("model-a.f32", "model-b.f32")

    def _mapped(self, name: str, numel: int) -> np.ndarray:
        assert self.state_dir is not None
        path = self.state_dir / name
        with open(path, "a+b") as f:
            if os.fstat(f.fileno()).st_size != numel * 4:
                f.truncate(numel * 4)
            mm = mmap.mmap(f.fileno(), max(1, numel * 4))
        return np.frombuffer(mm, dtype=np.float32, count=numel)

    def _keep(self, current: str, numel: int, model: Optional[np.ndarray] = None) -> None:
        """Hold the model in the state directory's file ``current`` (``model`` copied in when given; else
        the file already holds it), the other file spare."""
        self._current = current
        self.model = self._mapped(current, numel)
        if model is not None:
            np.copyto(self.model, model)
        self._spare = self._mapped(next(n for n in self._FILES if n != current), numel)

    def _load(self) -> None:
        assert self.state_dir is not None
        meta_path = self.state_dir / "global.json"
        if not meta_path.exists():
            return
        meta = json.loads(meta_path.read_text())
        if meta["model"].endswith(".npy"):  # written by an older service: one file per version
            old = np.load(self.state_dir / meta["model"])
            self._keep(self._FILES[0], old.size, old)
        else:
            self._keep(meta["model"], int(meta["numel"]))
        assert self.model is not None
        self.version = int(meta["version"])
        self.last_seq = {int(g): int(s) for g, s in meta["last_seq"].items()}
        self.clock.clocks = {int(g): int(c) for g, c in meta["clocks"].items()}
        self.clock.parked = set(self.clock.clocks)  # nobody is waited for until it speaks again
        self.taken = {int(e): {int(g): int(n) for g, n in by.items()} for e, by in meta.get("taken", {}).items()}
        self.resumed_from = self.version
        _log.warning("parameter service resumed from version %d (%d parameters) in %s", self.version,
                     self.model.size, self.state_dir)

    def _save(self) -> None:
        """Name the file now holding the model, with the version, clocks and sequence numbers."""
        if self.state_dir is None or self.model is None:
            return
        meta = {"model": self._current, "numel": int(self.model.size), "version": self.version,
                "last_seq": self.last_seq, "clocks": self.clock.clocks, "taken": self.taken}
        tmp = self.state_dir / "global.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.state_dir / "global.json")

    def _add(self, update: np.ndarray) -> None:
        """The model plus ``update``: in place, or (kept on disk) into the spare file, which the saved
        record then names, so a crash in between leaves the last saved model whole."""
        assert self.model is not None
        if self.state_dir is None:
            np.add(self.model, update, out=self.model)
            return
        np.add(self.model, update, out=self._spare)
        self.model, self._spare = self._spare, self.model
        self._current = next(n for n in self._FILES if n != self._current)

    # ---- operations ----------------------------------------------------

    def hello(self, group: int, init: bytes, numel: int) -> dict[str, Any]:
        with self._cond:
            if self.model is None:
                if not init:
                    raise ValueError("the service holds no model yet: the first leader must send it")
                model = np.frombuffer(init, dtype=np.float32, count=numel).copy()
                if self.state_dir is not None:
                    self._keep(self._FILES[0], numel, model)
                else:
                    self.model = model
                self._save()
            elif self.model.size != numel:
                raise ValueError(f"the service's model has {self.model.size} parameters, the group's {numel}")
            self.last_seen[group] = time.monotonic()
            self.clock.activate(group)
            return {"version": self.version, "last_seq": self.last_seq.get(group, -1), "node": node_identity()}

    def exchange(self, group: int, seq: int, kind: str, payload: bytes | bytearray | np.ndarray, numel: int,
                 wait: bool, epoch: int = -1, taken: int = 0, ticks: int = 1) -> dict[str, Any]:
        """Apply a group's update (once per ``seq``), then wait until the group is within the bound.
        ``epoch`` and ``taken`` report the group's progress as :meth:`progress` does; ``ticks``, the
        exchange periods the group worked since its last exchange (its clock advances by as many)."""
        with self._cond:
            if self.model is None:
                raise ValueError("exchange before hello")
            consumed = self._count(group, epoch, taken)
            duplicate = seq <= self.last_seq.get(group, -1)
            if not duplicate:
                self._add(decode(kind, payload, numel))
                self.version += 1
                self.last_seq[group] = seq
                self.clock.tick(group, ticks)
                self._save()
            self.last_seen[group] = time.monotonic()
            self._cond.notify_all()
            waited = 0.0
            if wait:
                started = time.monotonic()
                while not self.clock.may_proceed(group):
                    if time.monotonic() - started > self.wait_limit_s:
                        break
                    self._cond.wait(0.05)
                    self._park_silent(group)
                waited = time.monotonic() - started
                self.waits_s.append(waited)
            else:
                self.clock.park(group)
                self._cond.notify_all()
            gap = self.clock.gap(group)
            if wait:  # the staleness of a model a group trains on; a pushing group that does not wait discards it
                self.gaps[gap] += 1
            return {"version": self.version, "gap": gap, "duplicate": duplicate, "waited_s": waited,
                    "consumed": consumed}

    def _count(self, group: int, epoch: int, taken: int) -> int | None:
        if epoch < 0:
            return None
        if taken < 0:
            raise ValueError(f"taken must be >= 0, not {taken}")
        by_group = self.taken.setdefault(epoch, {})
        by_group[group] = max(by_group.get(group, 0), taken)
        return sum(by_group.values())

    def progress(self, group: int, epoch: int, taken: int) -> dict[str, Any]:
        """Group ``group`` has taken ``taken`` samples of ``epoch`` so far (a running total: repeats and
        lost answers count once). The answer's ``consumed``, what all groups have taken from the epoch,
        tells a group when the epoch is used up; no model moves and no clock ticks."""
        with self._cond:
            self.last_seen[group] = time.monotonic()
            return {"consumed": self._count(group, epoch, taken)}

    def _park_silent(self, asking: int) -> None:
        now = time.monotonic()
        for group, seen in self.last_seen.items():
            if group != asking and group not in self.clock.parked and now - seen > self.silent_after_s:
                _log.warning("group %d silent for %.1fs: no longer waited for", group, now - seen)
                self.clock.park(group)

    def park(self, group: int) -> None:
        with self._cond:
            self.clock.park(group)
            self.last_seen[group] = time.monotonic()
            self._cond.notify_all()

    def level(self) -> None:
        with self._cond:
            self.clock.level()
            self._cond.notify_all()

    def regroup(self, leaders: list[int]) -> None:
        """Groups were re-formed after a full mix: the new groups' clocks start level, the old ones go."""
        with self._cond:
            top = max(self.clock.clocks.values(), default=0)
            self.clock.clocks = {g: top for g in leaders}
            self.clock.parked = set()
            now = time.monotonic()
            for g in leaders:
                self.last_seen[g] = now
            self._cond.notify_all()

    def snapshot(self, into: Optional[np.ndarray] = None) -> bytes:
        """The global model's bytes; with ``into`` (a leader's shared buffer), copied there instead."""
        with self._cond:
            if self.model is None:
                raise ValueError("the service holds no model yet")
            if into is not None:
                if into.size != self.model.size:
                    raise ValueError(f"a buffer of {into.size} values for a model of {self.model.size}")
                np.copyto(into, self.model)
                return b""
            return self.model.tobytes()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            waits = sorted(self.waits_s)
            return {"version": self.version, "bound": self.clock.bound, "clocks": dict(self.clock.clocks),
                    "gaps": {str(k): v for k, v in sorted(self.gaps.items())}, "exchanges": sum(self.gaps.values()),
                    "wait_p50_s": waits[len(waits) // 2] if waits else 0.0, "wait_max_s": waits[-1] if waits else 0.0,
                    "resumed_from": self.resumed_from, "start_version": self.start_version,
                    "samples": {str(e): {str(g): n for g, n in sorted(by.items())}
                                for e, by in sorted(self.taken.items())}}


def _map_slots(slots: list[dict[str, Any]], numel: int) -> list[np.ndarray]:
    """A leader's shared buffers, each checked to be the very file the leader made (device and inode)."""
    arrays = []
    for slot in slots:
        path = str(slot["path"])
        with open(path, "r+b") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != (int(slot["dev"]), int(slot["ino"])) or st.st_size < numel * 4:
                raise ValueError(f"{path} is not the leader's buffer")
            mm = mmap.mmap(f.fileno(), max(1, numel * 4))
        arrays.append(np.frombuffer(mm, dtype=np.float32, count=numel))
    return arrays


class _Handler(socketserver.BaseRequestHandler):
    server: ParameterService
    slots: tuple[np.ndarray, ...] = ()  # this connection's leader's shared buffers, once it offered them
    # What this connection's leader holds of the global model, as far as the answers sent it (fp16, topk)
    held: Optional[np.ndarray] = None

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
                header, payload = recv_frame(sock)
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
                    fraction: float) -> tuple[dict[str, Any], bytes]:
        """The answer to a leader that pushes with a lossy codec: the whole model the first time on a
        connection, then only how the model differs from what the leader holds, in the same codec."""
        model = np.frombuffer(state.snapshot(), dtype=np.float32)
        if self.held is None or self.held.size != model.size:
            self.held = model.copy()
            return {**reply, "answer": "full"}, model.tobytes()
        body = encode_answer(kind, model - self.held, fraction)
        self.held += decode(kind, body, model.size)
        return {**reply, "answer": kind}, body

    def _one(self, state: GlobalModel, header: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        op = header["op"]
        if op == "hello":
            return state.hello(int(header["group"]), bytes(payload), int(header["numel"])), b""
        if op == "slots":
            self.slots = tuple(_map_slots(list(header["slots"]), int(header["numel"])))
            return {"ok": True}, b""
        if op == "exchange":
            update = self._slot(header, "slot")
            reply = state.exchange(int(header["group"]), int(header["seq"]), str(header["codec"]),
                                   payload if update is None else update,
                                   int(header["numel"]), bool(header.get("wait", True)),
                                   int(header.get("epoch", -1)), int(header.get("taken", 0)),
                                   int(header.get("ticks", 1)))
            answer = self._slot(header, "answer")
            if answer is None and header["codec"] in ("fp16", "topk"):
                return self._difference(state, reply, str(header["codec"]), float(header.get("fraction", 0.01)))
            return reply, state.snapshot(into=answer)
        if op == "progress":
            return state.progress(int(header["group"]), int(header["epoch"]), int(header["taken"])), b""
        if op == "park":
            state.park(int(header["group"]))
            return {"ok": True}, b""
        if op == "pull":
            if header.get("level"):
                state.level()
            return {"version": state.version}, state.snapshot(into=self._slot(header, "answer"))
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
    p.add_argument("--state-dir", default="", help="write the global model here after every exchange and "
                   "resume from it at start")
    p.add_argument("--token-file", required=True, help="file holding the job's token")
    p.add_argument("--port-file", default="", help="write the port listened on here once listening")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (rank 0) is gone")
    p.add_argument("--remove-state-with-parent", action="store_true",
                   help="the state directory is the job's temporary one: remove it when --parent-pid is gone")
    p.add_argument("--start-version", type=int, default=0,
                   help="the first model's version when --state-dir holds none (a run resumed from a checkpoint)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s param-service %(levelname)s %(message)s")
    token = Path(args.token_file).read_text().strip()
    state = GlobalModel(args.bound, Path(args.state_dir) if args.state_dir else None,
                        start_version=args.start_version)
    with ParameterService((args.host, args.port), state, token) as server:
        port = server.server_address[1]
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            os.replace(tmp, args.port_file)
        _log.info("listening on %s:%d (bound %d, pid %d)", args.host, port, args.bound, os.getpid())
        if args.parent_pid:
            remove = Path(args.state_dir) if args.remove_state_with_parent and args.state_dir else None
            threading.Thread(target=_exit_with, args=(args.parent_pid, server, remove), daemon=True).start()
        server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
