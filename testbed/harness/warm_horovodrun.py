"""`horovodrun`, started from an interpreter that has already imported what its start-up probe imports.

Before it starts a rank, every `horovodrun` asks whether Horovod was built with Gloo (or MPI): it
forks a child that imports `horovod.torch`, and with it torch (`horovod.common.util.gloo_built`).
That costs about 1.5 s of CPU and of wall time per job, before the job's first rank exists; the
test tiers start over a hundred jobs on two cores. Here one server process imports
`horovod.torch` and Horovod's launcher once, then forks for every job and runs Horovod's own
`horovodrun` entry point (`horovod.runner.launch.run_commandline`) with the job's arguments,
environment, folder and log. Horovod's code runs unchanged, its probe included (which then finds
torch imported); the ranks are started by Horovod as always, each a fresh interpreter.

Each launcher leads a session of its own, as with `Popen(start_new_session=True)`, and is
handed back as a `WarmProcess`, which answers what the harness asks of a `subprocess.Popen`
(its pid, `poll`, `wait`, `returncode`); its group is signalled with `kill_group`.
The server is started on first use and ends when the process that started it does.

Run as `python -m testbed.harness.warm_horovodrun`, it is that server: it reads one JSON request
a line on stdin and answers each with the launcher's pid.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from testbed import checkout_on_path

__all__ = ["WarmProcess", "start_horovodrun"]

_POLL_S = 0.02


class WarmProcess:
    """A launcher the server forked: its pid, and its exit code once the server has reaped it
    (as `Popen.returncode`: the code, or minus the signal that ended it)."""

    def __init__(self, args: Sequence[str], pid: int, status: Path, server: _Server) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.returncode = int(self._status.read_text())
            if self.returncode is None and not self._server.alive() and not psutil.pid_exists(self.pid):
                self.returncode = -int(signal.SIGKILL)  # reaped by init: its code is lost with the server
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_S)
        return code


class _Server:
    """The client's end: one server per process, started on first use, stopped at exit."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="crossover-warm-horovodrun-"))
        self._stderr = self._dir / "server.log"
        env = {**os.environ, "PYTHONPATH": checkout_on_path(os.environ)}
        with open(self._stderr, "wb") as err:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
        self._lock = threading.Lock()
        self._count = 0
        atexit.register(self.close)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def launch(self, args: Sequence[str], env: Mapping[str, str], cwd: Path | None, log: Path) -> WarmProcess:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        log.write_bytes(b"")  # there, and empty, when this returns (as with Popen)
        with self._lock:
            self._count += 1
            status = self._dir / f"{self._count}.rc"
            argv = ["horovodrun", *args]
            request = {"argv": argv, "env": dict(env), "cwd": str(cwd or Path.cwd()), "log": str(log),
                       "status": str(status)}
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
                answer = self._proc.stdout.readline()
            except BrokenPipeError:
                answer = b""
            if not answer:
                raise RuntimeError(f"the warm horovodrun server exited {self._proc.poll()}:\n"
                                   f"{self._stderr.read_text(errors='replace')[-2000:]}")
        return WarmProcess(argv, int(answer), status, self)

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_server: _Server | None = None
_server_lock = threading.Lock()


def start_horovodrun(args: Sequence[str], env: Mapping[str, str], log: Path, cwd: Path | None = None) -> WarmProcess:
    """Start `horovodrun ARGS` with exactly `env`, in `cwd`, its output (stdout and stderr) to `log`."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = _Server()
        server = _server
    return server.launch(args, env, cwd, log)


def _become_launcher(request: dict[str, Any], run: Callable[[], Any]) -> Any:
    """In the forked child: the job's session, output, folder, environment and arguments; then Horovod's
    `horovodrun`. Returns its exit status, for the child to leave as any interpreter does (`sys.exit`,
    running Horovod's exit handlers)."""
    os.setsid()
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND)  # made empty by the client
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    try:
        return run()
    except SystemExit as exc:
        return exc.code
    except BaseException:
        traceback.print_exc()
        return 1


def _reap(children: dict[int, str]) -> None:
    """Write the exit code of every launcher that has ended to its status file (whole, by a rename)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, path)


def _serve() -> None:
    import horovod.torch  # noqa: F401  what every horovodrun's build probe imports, once
    from horovod.runner.launch import run_commandline

    gc.freeze()  # what is imported stays out of every launcher's collections, as from a fresh interpreter
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's Ctrl-C is its to handle; EOF ends us
    children: dict[int, str] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], _POLL_S if children else None)
        _reap(children)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                sys.exit(_become_launcher(request, run_commandline))
            children[pid] = request["status"]
            os.write(1, f"{pid}\n".encode())


if __name__ == "__main__":
    _serve()
