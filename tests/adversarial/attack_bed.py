"""The adversarial tier: attacks on a live `crossoverd` while a well-behaved job trains beside them.

Each test starts a real daemon, a real two-rank `horovodrun` job (the victim),
and an attack; it asserts what the victim sees (its grant waits, the control
plane answering within a second, the daemon stopping on SIGTERM) and that the
attack is refused or bounded. Every process is killed at teardown, even on failure.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from crossover.protos.event_records import Grant
from testbed.harness.daemon import DaemonProc, queue_state
from testbed.harness.jobs import Job, horovodrun, with_import

VICTIM_ITERS = "150"
NOBODY, NOGROUP = 65534, 65534  # the second local user, and the socket group it is in


def drop_to_nobody() -> None:
    """preexec_fn: become `nobody`, a member of the socket group only."""
    os.setgroups([NOGROUP])
    os.setgid(NOGROUP)
    os.setuid(NOBODY)


def shared_folder() -> Path:
    """A fresh folder under /tmp that `nobody` may traverse (the caller removes it); needs root."""
    folder = Path(tempfile.mkdtemp(prefix="crossover-adv-", dir="/tmp"))
    folder.chmod(0o755)
    return folder


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def start_victim(d: DaemonProc, tmp: Path, name: str = "victim", iters: str = VICTIM_ITERS) -> Job:
    """A two-rank job of the shared MLP workload, scheduled by `d`; `Job.stop()` may end it before `iters`."""
    script = with_import(tmp)
    return horovodrun(name, script, tmp, np=2, args=("--iters", iters), env={"CROSSOVER_SOCKET": str(d.socket)},
                      stoppable=True)


def stop_after_grants(d: DaemonProc, victim: Job, grants: int, timeout: float = 60) -> None:
    """Let the victim run until the daemon logged `grants` of its grants, then have it stop."""
    deadline = time.monotonic() + timeout
    while len(grant_waits(d, victim.name)) < grants and victim.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    victim.stop()


def answers_within(d: DaemonProc, seconds: float) -> float:
    """How long `crossover queue` takes on the rank socket; fails past `seconds`."""
    t0 = time.monotonic()
    queue_state(d.socket, timeout=seconds)
    return time.monotonic() - t0


def grant_waits(d: DaemonProc, job_name: str) -> list[float]:
    """Every grant wait the daemon logged for a job, in seconds."""
    return [Grant.of(e).waited_s for e in d.events() if e.name is Grant.name and e.job_name == job_name]


def stops_on_sigterm(d: DaemonProc, grace_s: float = 5.0) -> float:
    """Seconds from SIGTERM to the daemon's exit; fails past `grace_s`."""
    assert d.proc is not None
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(grace_s)
    return time.monotonic() - t0


def event_kinds(d: DaemonProc) -> list[Any]:
    return [e.name for e in d.events()]
