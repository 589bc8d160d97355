"""The warm `horovodrun` answers as a started `horovodrun` would: its ranks see the job's environment and
folder, its output goes to its log, and its exit code (or the signal that ended it) comes back."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from testbed.harness.daemon import kill_group
from testbed.harness.warm_horovodrun import start_horovodrun

pytestmark = pytest.mark.timeout(120)

_PROBE = "import os; print('rank', os.environ['HOROVOD_RANK'], os.environ['MARK'], os.getcwd())"


def test_a_job_runs_its_ranks_with_its_environment_and_folder_and_exits_0(tmp_path):
    log = tmp_path / "job.log"
    proc = start_horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-c", _PROBE],
                            env={**os.environ, "MARK": "m1"}, log=log, cwd=tmp_path)
    assert log.exists()
    assert proc.wait(60) == 0, log.read_text()
    text = log.read_text()
    for rank in (0, 1):
        assert f"rank {rank} m1 {tmp_path}" in text, text


def test_horovodruns_own_refusal_and_a_killed_launcher_come_back_as_popen_says_them(tmp_path):
    bad = start_horovodrun(["--gloo", "python"], env=dict(os.environ), log=tmp_path / "bad.log")
    assert bad.wait(60) == 2
    assert "the following arguments are required: -np" in (tmp_path / "bad.log").read_text()

    slow = start_horovodrun(["-np", "1", "-H", "localhost:1", "--gloo", sys.executable, "-c",
                             "import time; time.sleep(60)"], env=dict(os.environ), log=tmp_path / "slow.log")
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(0.2)
    assert slow.poll() is None
    kill_group(slow)
    assert slow.wait(30) == -signal.SIGKILL
