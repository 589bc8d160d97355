"""Two real Horovod ranks (`horovodrun`, Gloo) through `HostStager`: what the stager's thread enqueues, Horovod
reduces exactly as its own allreduce does, and a model trained through Horovod's DistributedOptimizer with staging
forced on ends bit-identical to the one without (testbed/workloads/staging_check.py)."""
from __future__ import annotations

import json

import pytest

from testbed.harness.jobs import WORKLOADS, horovodrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_staged_allreduces_equal_horovods_own_on_every_rank(jobs, tmp_path):
    job = horovodrun("staging", WORKLOADS / "staging_check.py", tmp_path, np=2)
    jobs.append(job)
    assert job.wait(90) == 0, job.output()[-3000:]
    for rank in (0, 1):
        result = json.loads((job.out / f"rank{rank}.json").read_text())
        assert set(result["max_abs_diff"]) == {"average", "sum", "scaled", "grouped"}
        assert all(d < 1e-6 for d in result["max_abs_diff"].values()), result
        assert result["params_identical"], result
        # 5 steps: 4 tensors each one by one, then 1 group each
        assert result["staged_in_training"] == 5 * 4 + 5 * 1, result
