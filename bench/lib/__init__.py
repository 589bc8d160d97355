"""What every benchmark shares: where the checkout is, the machine it ran on, a few statistics,
result files, and real horovodrun jobs (through `tools.harness`, like the tests)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tools.harness.jobs import CHECKOUT, WORKLOADS, horovodrun, with_import

__all__ = ["ROOT", "WORKLOAD", "finish_job", "machine", "mean", "percentile", "script_with_import", "start_job",
           "write_json"]

ROOT = CHECKOUT
WORKLOAD = WORKLOADS / "train_mlp.py"


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def script_with_import(workdir: Path, src: Path = WORKLOAD) -> Path:
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


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
