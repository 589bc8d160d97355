"""Real `horovodrun` jobs for benchmarks, started through `tools.harness` like the tests' jobs."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tools.harness.jobs import WORKLOADS, horovodrun, with_import

__all__ = ["WORKLOAD", "finish_job", "script_with_import", "start_job"]

WORKLOAD = WORKLOADS / "train_mlp.py"


def script_with_import(workdir: Path, src: Path = WORKLOAD) -> Path:
    """A copy of ``src`` in ``workdir`` with `import crossover.auto` as its first line."""
    return with_import(workdir, src)


def start_job(name: str, script: Path, workdir: Path, np: int, args: list[str], env: dict[str, str]
              ) -> tuple[subprocess.Popen, Path]:
    """`horovodrun -np NP` (Gloo) running `script --out OUT args`; its log is `workdir/NAME.log`."""
    job = horovodrun(name, script, workdir, np=np, args=args, env=env)
    return job.proc, job.out


def finish_job(proc: subprocess.Popen, out: Path, timeout: float = 600) -> list[dict[str, Any]]:
    """Wait for a job and return what its ranks wrote; a failed or stuck job raises."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"job failed ({rc}); see {out.parent}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
