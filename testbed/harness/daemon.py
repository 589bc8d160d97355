"""One way to start a real `crossoverd` and know it serves: its socket answers `crossover queue`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from crossover.protos.event_file import Event

__all__ = ["BIN", "DaemonProc", "cli", "kill_group", "queue_state", "set_policy"]

BIN = Path(sys.executable).parent  # the virtualenv's console scripts: crossoverd, crossover, horovodrun


class _Started(Protocol):
    pid: int


def kill_group(proc: _Started, sig: int = signal.SIGKILL) -> None:
    """Signal `proc`'s whole process group (every process here starts its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class DaemonProc:
    """A `crossoverd` on `socket`, writing its events to `event_log` and its output to `log`.

    Its policy is what `args` say throughout: `--no-adapt` unless `args` give `--adapt` (tests that check a
    policy's order must not see a device probe unscheduled windows)."""

    socket: Path
    event_log: Path
    log: Path
    args: list[str]
    nice: int = 0
    cpus: frozenset[int] = frozenset()  # run it on these CPUs only (empty: wherever its parent may run)
    proc: subprocess.Popen | None = None

    @classmethod
    def in_dir(cls, workdir: Path, *args: str, name: str = "d", nice: int = 0,
               cpus: frozenset[int] = frozenset()) -> DaemonProc:
        """A daemon whose socket, event log and log are `workdir/NAME.*`."""
        return cls(socket=workdir / f"{name}.sock", event_log=workdir / f"{name}.events.jsonl",
                   log=workdir / f"{name}.log", args=list(args), nice=nice, cpus=cpus)

    def start(self, timeout: float = 15.0) -> DaemonProc:
        """Start it and return once it answers a queue request; raise with its log's tail if it does not."""
        prefix = ["nice", "-n", str(self.nice)] if self.nice else []
        if self.cpus:  # taskset pins the process before exec, so every daemon thread inherits it
            prefix = ["taskset", "-c", ",".join(map(str, sorted(self.cpus))), *prefix]
        cmd = [*prefix, str(BIN / "crossoverd"), "--socket", str(self.socket), "--event-log", str(self.event_log),
               "--no-adapt", *self.args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"crossoverd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.ready():
                return self
            time.sleep(0.1)
        kill_group(self.proc)
        self.proc.wait()
        raise RuntimeError(f"crossoverd did not come up in {timeout:.0f}s: {self.log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("crossoverd was not started")
        return self.proc.pid

    def ready(self) -> bool:
        """The readiness probe: the socket exists and the queue request `crossover queue` makes succeeds on it
        (in-process, as `queue_state`: a CLI process per probe cost half a second of every daemon's start)."""
        if not self.socket.exists():
            return False
        from crossover.client.admin import AdminError

        try:
            queue_state(self.socket, timeout=2.0)
        except AdminError:  # not serving yet: the next probe asks again
            return False
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal it and wait; a daemon that outlives `timeout` has its group killed and the wait raises."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            self.proc.wait()
            raise

    def kill(self) -> None:
        """Kill its group without asking (teardown after a failure)."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
            self.proc.wait()

    def events(self) -> list[Event]:
        """Its event log as it stands now (typed: `crossover.protos.event_file`); still readable after it stopped."""
        from crossover.protos.event_file import read_events

        return read_events(self.event_log)

    def __enter__(self) -> DaemonProc:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            pass


def cli(*args: str, socket: Path, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run the `crossover` CLI against `socket`; with `check`, a non-zero exit raises."""
    res = subprocess.run([str(BIN / "crossover"), *args, "--socket", str(socket)], capture_output=True, text=True,
                         timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"crossover {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


def queue_state(socket: Path, timeout: float = 5.0) -> dict[str, Any]:
    """The daemon's queue as `crossover queue --json` prints it, fetched in-process (cheap enough to poll)."""
    from crossover.client.admin import AdminClient
    from crossover.client.cli.formatting import to_json

    with AdminClient(socket, timeout=timeout) as admin:
        return to_json("queue", admin.queue())


def set_policy(socket: Path, name: str, timeout: float = 5.0) -> None:
    """Switch the daemon's policy as `crossover policy NAME` does (on its admin socket), in-process: cheap
    enough to repeat every second or two while a job runs."""
    from crossover.client.admin import AdminClient

    with AdminClient(socket, timeout=timeout) as admin:
        admin.set_policy(name)
