"""The README's quickstart, as a newcomer types it: a daemon on one CPU core and two `torchrun` jobs of
`examples/train_ddp.py`, which take turns on it and finish."""
from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from testbed.harness.daemon import kill_group
from testbed.harness.jobs import CHECKOUT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_two_example_jobs_take_turns_and_finish(daemon_factory, tmp_path):
    d = daemon_factory("--cpu-devices", "1")
    procs = []
    for job in ("a", "b"):
        env = {**os.environ, "CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_JOB_NAME": job,
               "PYTHONPATH": str(CHECKOUT)}
        log = open(tmp_path / f"{job}.log", "wb")
        procs.append((job, log, subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(CHECKOUT / "examples" / "train_ddp.py"), "--steps", "150"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)))
    try:
        for job, _log, proc in procs:
            assert proc.wait(200) == 0, (tmp_path / f"{job}.log").read_text()[-3000:]
    finally:
        for _, log, proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
            log.close()
    for job in ("a", "b"):
        out = (tmp_path / f"{job}.log").read_text()
        assert "150 steps in" in out and "unscheduled" not in out, out[-2000:]
    grants = collections.Counter(e.job_name for e in d.events() if e.name == "grant")
    assert grants["a"] >= 150 and grants["b"] >= 150, dict(grants)
