"""A daemon in its own process namespace (a Kubernetes pod without hostPID) serves ranks it cannot see.

Before: the daemon checked each rank's liveness by the pid the rank claimed
(its own os.getpid()); a daemon in another pid namespace found no such process
and removed every rank as "gone" at once, so the pods needed `hostPID: true`.
Now a pid the daemon cannot see is unknown: the kernel names the peer of the
session socket (SO_PEERCRED gives 0 for a process outside the daemon's
namespace), and the rank's connection and heartbeats say whether it lives.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
from attack_bed import grant_waits, start_victim, stop_after_grants

from crossover.protos.event_records import Leave
from testbed.harness.daemon import BIN, DaemonProc, queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]


@pytest.fixture
def namespaced_daemon(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a process namespace needs root and unshare (util-linux)")
    d = DaemonProc.in_dir(tmp_path, "--cpu-devices", "1", "--policy", "exclusive")
    with open(d.log, "ab") as out:
        d.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", str(BIN / "crossoverd"),
                                   "--socket", str(d.socket), "--event-log", str(d.event_log), *d.args],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while not d.ready():
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log.read_text()[-2000:]
        time.sleep(0.1)
    yield d
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()


def test_ranks_the_daemon_cannot_see_are_served_not_evicted(namespaced_daemon, jobs, tmp_path):
    d = namespaced_daemon
    victim = start_victim(d, tmp_path, iters="3000")
    jobs.append(victim)
    deadline = time.monotonic() + 60
    pids = []
    while time.monotonic() < deadline and not pids:
        ranks = [r for dev in queue_state(d.socket)["devices"] for key in ("holders", "waiting", "others")
                 for r in dev.get(key, [])]
        pids = [int(r["pid"]) for r in ranks if r.get("job_name") == "victim"]
        time.sleep(0.1)
    stop_after_grants(d, victim, 120)
    assert victim.wait(120) == 0, victim.output()[-3000:]
    leaves = [e for e in d.events() if e.name == "leave" and e.job_name == "victim"]
    assert leaves and not any("gone" in Leave.of(e).reason for e in leaves), leaves
    assert len(grant_waits(d, "victim")) > 100  # scheduled throughout
    assert pids and set(pids) == {0}, pids  # unknown: not the rank's claim, which means nothing here
