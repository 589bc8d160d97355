"""A low job's real Horovod ranks mark their TCP traffic lower effort (DSCP CS1), Gloo's rings among it, and
take the mark off when the operator raises the job; read from outside with `ss --tos`, as a network sees it.
(A job never low is never told a class, so it marks nothing: `tests/unit/client/test_traffic_class.py`.)"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from testbed.harness.daemon import cli, queue_state
from testbed.harness.jobs import horovodrun, with_import
from testbed.harness.polling import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to read sockets' TOS")]

_LINE = re.compile(r"pid=(\d+),fd=\d+.*\btos:(0x[0-9a-f]+|0)\b")


def _tos_by_pid(pids: set[int]) -> dict[int, list[int]]:
    """The TOS byte of every established TCP socket each of `pids` holds."""
    out = subprocess.run(["ss", "-tnpH", "--tos", "state", "established"], capture_output=True, text=True,
                         timeout=10).stdout
    found: dict[int, list[int]] = {pid: [] for pid in pids}
    for line in out.splitlines():
        m = _LINE.search(line)
        if m and int(m.group(1)) in pids:
            found[int(m.group(1))].append(int(m.group(2), 16))
    return found


def _both_ranks(socket, job: str) -> set[int] | None:
    """The pids of the job's two ranks, once the daemon has both."""
    pids = {r["pid"] for dev in queue_state(socket)["devices"] for r in dev["holders"] + dev["waiting"] + dev["others"]
            if r["job_name"] == job}
    return pids if len(pids) == 2 else None


def test_a_low_jobs_ranks_mark_their_rings_and_unmark_them_when_raised(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "2", "--policy", "crossover")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    low = horovodrun("opportunist", script, tmp_path, np=2, args=("--iters", "3000"), stoppable=True,
                     env={**env, "CROSSOVER_PRIORITY": "low"})
    jobs.append(low)
    low_pids = wait_until(lambda: _both_ranks(d.socket, "opportunist"), 60, "both low ranks", interval=0.2)

    def marked() -> bool:  # each rank holds at least its Gloo connection to the other rank
        return all(0x20 in tos for tos in _tos_by_pid(low_pids).values())

    wait_until(marked, 30, "the low ranks' sockets to carry CS1", interval=0.2)
    assert all(tos and all(t == 0x20 for t in tos) for tos in _tos_by_pid(low_pids).values()), \
        f"a low rank's TCP socket without the mark: {_tos_by_pid(low_pids)}"

    cli("priority", "opportunist", "normal", socket=d.socket)
    wait_until(lambda: all(tos and all(t == 0 for t in tos) for tos in _tos_by_pid(low_pids).values()), 30,
               "the raised job's sockets to lose the mark", interval=0.2)
    for j in jobs:
        j.stop()
    for j in jobs:
        assert j.wait(120) == 0, j.output()[-3000:]
