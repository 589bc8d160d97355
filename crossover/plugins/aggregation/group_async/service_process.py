"""Rank 0's keeper of the parameter service process: started at the first boundary, restarted on the same
port if it dies, stopped (and its state removed, when it is the job's own) at the end."""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from crossover.plugins.aggregation.group_async.link import ServiceError
from crossover.plugins.aggregation.group_async.shared_buffers import SHM_DIR, shared_memory_usable

__all__ = ["ServiceProcess", "start_for_job", "state_root"]

_log = logging.getLogger(__name__)


def state_root() -> str | None:
    """Where a job's service keeps its model when the user names no folder: /dev/shm where there is one (the
    model is rewritten every exchange), else the system's temporary folder (None)."""
    return str(SHM_DIR) if shared_memory_usable() else None


class ServiceProcess:
    """Rank 0's parameter service: started at the first boundary, restarted on the same port if it dies."""

    def __init__(self, host: str, bound: int, state_dir: str = "", port: int = 0, start_version: int = 0,
                 schedule: str = "fixed", period_s: float = 0.5) -> None:
        self.host = host
        self.bound = bound
        self.schedule, self.period_s = schedule, period_s  # the service switches a staged schedule's stage
        self.port = port
        self.start_version = start_version  # a resumed run's version (what its state directory holds wins)
        # Without a directory of the user's, the job's own in memory (the model is rewritten every exchange).
        self.owns_state = not state_dir
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="crossover-params-", dir=state_root())
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self._dir = Path(tempfile.mkdtemp(prefix="crossover-service-"))
        (self._dir / "token").write_text(self.token)
        os.chmod(self._dir / "token", 0o600)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.restarts = 0

    def start(self, timeout_s: float = 60.0) -> tuple[str, int]:
        port_file = self._dir / "port"
        port_file.unlink(missing_ok=True)
        log = open(self._dir / "service.log", "ab")
        cmd = [sys.executable, "-m", "crossover.plugins.aggregation.group_async.service", "--host", self.host,
               "--port", str(self.port), "--bound", str(self.bound),
               "--schedule", self.schedule, "--period", repr(self.period_s), "--state-dir", self.state_dir,
               "--token-file", str(self._dir / "token"), "--port-file", str(port_file),
               "--parent-pid", str(os.getpid()), "--start-version", str(self.start_version)] + \
            (["--remove-state-with-parent"] if self.owns_state else [])
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # in the job's process group
        log.close()
        (Path(self.state_dir) / "service.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"exited with {code}" if code is not None else f"wrote no port within {timeout_s:g} s"
                raise ServiceError(f"the parameter service {why}; its log ends: {self._log_tail()!r}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        _log.info("parameter service pid %d on %s:%d, state in %s", self.proc.pid, self.host, self.port,
                  self.state_dir)
        return self.host, self.port

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines of the service's log (the folder holding it is removed when the job ends)."""
        try:
            text = (self._dir / "service.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

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
        if self.owns_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def start_for_job(local_size: int, world: int, bound: int, state_dir: str, start_version: int,
                  schedule: str = "fixed", period_s: float = 0.5,
                  port: int = 0) -> tuple[Optional[ServiceProcess], Any]:
    """Rank 0: start the job's service, on loopback when every rank is on this node. The service and the
    address every leader attaches to, `(host, port, token)`; `(service, None)` when it could not start
    (groups then train synchronously inside and never exchange)."""
    single_host = local_size == world
    service = ServiceProcess("127.0.0.1" if single_host else "0.0.0.0", bound, state_dir,
                             port=port, start_version=start_version, schedule=schedule, period_s=period_s)
    try:
        _, port = service.start()
    except (OSError, ServiceError) as exc:
        _log.warning("group_async: could not start the parameter service (%s); groups train "
                     "synchronously inside and never exchange", exc)
        return service, None
    reach = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    return service, (reach, port, service.token)
