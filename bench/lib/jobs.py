"""Real `horovodrun` and `torchrun` jobs for benchmarks, started through `testbed.harness` like the tests' jobs."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from testbed.harness.daemon import kill_group
from testbed.harness.jobs import WORKLOADS, horovodrun, rank_summaries, torchrun
from testbed.harness.warm_horovodrun import WarmProcess

__all__ = ["WORKLOAD_OF", "finish_job", "start_job"]

# Each framework's MLP workload, taking the same --width, --depth and --batch.
WORKLOAD_OF = {"horovod": WORKLOADS / "train_mlp.py", "ddp": WORKLOADS / "train_ddp.py"}


def start_job(name: str, script: Path, workdir: Path, np: int, args: list[str], env: dict[str, str],
              framework: str = "horovod") -> tuple[WarmProcess | subprocess.Popen[bytes], Path]:
    """`horovodrun -np NP` (Gloo), or `torchrun --nproc-per-node NP` for "ddp", running `script --out OUT args`;
    its log is `workdir/NAME.log`."""
    if framework == "ddp":
        job = torchrun(name, script, workdir, nproc=np, args=args, env=env)
    else:
        job = horovodrun(name, script, workdir, np=np, args=args, env=env)
    return job.proc, job.out


def finish_job(proc: WarmProcess | subprocess.Popen[bytes], out: Path, timeout: float = 600
               ) -> list[dict[str, Any]]:
    """Wait for a job and return what its ranks wrote; a failed or stuck job raises."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"job failed ({rc}); see {out.parent}")
    return rank_summaries(out)
