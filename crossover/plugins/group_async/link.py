"""A group leader's link to the parameter service, and rank 0's keeper of the service process.

Fail-open: when the service cannot be reached, :meth:`ServiceLink.exchange`
returns ``None`` (warned once per outage), the group keeps training
synchronously inside, and the next exchange tries to re-attach. What the
group learned meanwhile is not lost: the leader's base stays where the last
acknowledged exchange left it, so its next update carries every step since.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from crossover.plugins.group_async.codec import Codec, decode
from crossover.plugins.group_async.wire import WireError, recv_frame, send_frame

__all__ = ["ServiceLink", "ServiceProcess", "ServiceError"]

_log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """The service refused a call (its message says why): a misuse, not an outage, so it is raised."""


class ServiceLink:
    """One leader's connection: ``hello`` once, then ``exchange`` its updates for the global model."""

    def __init__(self, address: tuple[str, int], token: str, group: int, codec: Codec,
                 timeout_s: float = 150.0) -> None:
        self.address = address
        self.token = token
        self.group = group
        self.codec = codec
        self.timeout_s = timeout_s
        self.seq = 0
        self.base: Optional[torch.Tensor] = None
        self.in_flight: Optional[tuple[int, torch.Tensor]] = None  # (seq, what the service adds for it)
        self.consumed: Optional[int] = None  # the last answer's count of samples all groups took from the epoch
        self.lost_since: Optional[float] = None
        self.outages = 0
        self.gaps: list[int] = []
        self.exchange_s: list[float] = []
        self._sock: Optional[socket.socket] = None

    # ---- connection ----------------------------------------------------

    def _call(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytearray]:
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=5.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            send_frame(sock, {"op": "auth", "token": self.token})
            reply, _ = recv_frame(sock)
            if "error" in reply:
                sock.close()
                raise ServiceError(reply["error"])
            self._sock = sock
        send_frame(self._sock, header, payload)
        reply, body = recv_frame(self._sock)
        if "error" in reply:
            raise ServiceError(reply["error"])
        return reply, body

    def _drop(self, exc: BaseException) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            self.outages += 1
            _log.warning("group %d: the parameter service at %s:%d is unreachable (%s); training on inside the "
                         "group and re-attaching at each exchange", self.group, *self.address, exc)

    def _attach(self, flat: torch.Tensor) -> None:
        """``hello``; the first leader ever seeds the service's model with its own parameters."""
        reply, _ = self._call({"op": "hello", "group": self.group, "numel": flat.numel()},
                              flat.detach().cpu().numpy().astype(np.float32).tobytes())
        if self.in_flight is not None and reply["last_seq"] >= self.in_flight[0] and self.base is not None:
            self.base = self.base + self.in_flight[1]  # the service applied it before the answer was lost
            self.seq = self.in_flight[0] + 1
            self.in_flight = None
        else:
            self.seq = max(self.seq, reply["last_seq"] + 1)
        if self.lost_since is not None:
            _log.warning("group %d: re-attached to the parameter service after %.1fs (version %d)", self.group,
                         time.monotonic() - self.lost_since, reply["version"])
            self.lost_since = None

    def start(self, flat: torch.Tensor) -> None:
        """Attach at the start of training; the base is the model every rank starts from."""
        self.base = flat.detach().clone()
        try:
            self._attach(flat)
        except (OSError, WireError) as exc:
            self._drop(exc)

    # ---- operations ----------------------------------------------------

    def exchange(self, flat: torch.Tensor, wait: bool = True, scale: float = 1.0, epoch: int = -1,
                 taken: int = 0) -> Optional[torch.Tensor]:
        """Push ``scale * (flat - base)``, return the global model (and make it the base); ``None`` if
        unreachable. ``taken``: the samples the group has taken from ``epoch`` so far (see :meth:`progress`)."""
        assert self.base is not None, "start() first"
        started = time.perf_counter()
        self.consumed = None
        try:
            if self._sock is None:
                self._attach(flat)
            update = (flat.detach() - self.base) * scale
            payload = self.codec.encode(update)
            self.in_flight = (self.seq, torch.from_numpy(decode(self.codec.kind, payload, update.numel()).copy()))
            reply, body = self._call({"op": "exchange", "group": self.group, "seq": self.seq,
                                      "codec": self.codec.kind, "numel": update.numel(), "wait": wait,
                                      "epoch": epoch, "taken": taken}, payload)
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None
        if reply.get("duplicate"):  # hello() settles a lost answer, so this is a bug, not an outage
            _log.error("group %d: the service had already applied exchange %d; skipping it", self.group, self.seq)
            self.in_flight = None
            self.seq += 1
            return None
        self.in_flight = None
        self.seq += 1
        self.consumed = reply.get("consumed")
        if wait:
            self.gaps.append(int(reply["gap"]))
        self.exchange_s.append(time.perf_counter() - started)
        model = torch.from_numpy(np.frombuffer(body, dtype=np.float32).copy())
        self.base = model.clone()
        return model

    def progress(self, epoch: int, taken: int) -> Optional[int]:
        """Tell the service the group has taken ``taken`` samples of ``epoch`` so far (a running total,
        so a repeated call counts once); the answer is what all groups have taken (``None`` if unreachable).
        No model travels and no clock moves: a group may ask at every step."""
        try:
            if self._sock is None and self.base is not None:
                self._attach(self.base)
            reply, _ = self._call({"op": "progress", "group": self.group, "epoch": epoch, "taken": taken})
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None
        return int(reply["consumed"])

    def park(self) -> None:
        """This group is between epochs or done: the others must not wait for it."""
        try:
            if self._sock is not None:
                self._call({"op": "park", "group": self.group})
        except (OSError, WireError) as exc:
            self._drop(exc)

    def pull(self, level: bool = False) -> Optional[torch.Tensor]:
        """The global model (``level``: every group has now seen every update; clocks are evened)."""
        try:
            if self._sock is None and self.base is not None:
                self._attach(self.base)
            _, body = self._call({"op": "pull", "level": level})
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None
        model = torch.from_numpy(np.frombuffer(body, dtype=np.float32).copy())
        self.base = model.clone()
        return model

    def regroup(self, leaders: list[int]) -> None:
        """The groups changed (every model is mixed): only these leaders' clocks count, all level."""
        try:
            if self._sock is not None:
                self._call({"op": "regroup", "leaders": leaders})
        except (OSError, WireError) as exc:
            self._drop(exc)

    def stats(self) -> Optional[dict[str, Any]]:
        try:
            return self._call({"op": "stats"})[0]
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ServiceProcess:
    """Rank 0's parameter service: started at the first boundary, restarted on the same port if it dies."""

    def __init__(self, host: str, bound: int, state_dir: str = "", port: int = 0) -> None:
        self.host = host
        self.bound = bound
        self.port = port
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="crossover-params-")
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self._dir = Path(tempfile.mkdtemp(prefix="crossover-service-"))
        (self._dir / "token").write_text(self.token)
        os.chmod(self._dir / "token", 0o600)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.restarts = 0

    def start(self, timeout_s: float = 30.0) -> tuple[str, int]:
        port_file = self._dir / "port"
        port_file.unlink(missing_ok=True)
        log = open(self._dir / "service.log", "ab")
        cmd = [sys.executable, "-m", "crossover.plugins.group_async.service", "--host", self.host,
               "--port", str(self.port), "--bound", str(self.bound), "--state-dir", self.state_dir,
               "--token-file", str(self._dir / "token"), "--port-file", str(port_file),
               "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # in the job's process group
        log.close()
        (Path(self.state_dir) / "service.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(f"the parameter service did not start; see {self._dir / 'service.log'}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        _log.info("parameter service pid %d on %s:%d, state in %s", self.proc.pid, self.host, self.port,
                  self.state_dir)
        return self.host, self.port

    def ensure_running(self) -> None:
        """Restart the service if it died (same port, resuming from its state directory)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            _log.warning("the parameter service (pid %d) exited with %s; restarting it (restart %d)",
                         self.proc.pid, self.proc.returncode, self.restarts)
            try:
                self.start()
            except ServiceError as exc:
                _log.warning("%s", exc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
