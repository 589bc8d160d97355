"""Real `horovodrun` and `torchrun` jobs on this machine, each in its own process group, with their logs and results."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from testbed import CHECKOUT, checkout_on_path
from testbed.workloads.stop_file import request_stop

from .daemon import kill_group
from .warm_horovodrun import WarmProcess, start_horovodrun

__all__ = ["CHECKOUT", "WORKLOADS", "Job", "exit_outcome", "horovodrun", "rank_summaries", "torchrun", "with_import"]

WORKLOADS = CHECKOUT / "testbed" / "workloads"


@dataclass
class Job:
    name: str
    proc: WarmProcess | subprocess.Popen[bytes]  # the launcher: `horovodrun` (warm_horovodrun) or `torchrun`
    out: Path
    log: Path
    started: float = field(default_factory=time.monotonic)
    stop_file: Path | None = None  # `horovodrun(stoppable=True)`: the workload's --stop-file

    def stop(self, ahead: int = 20) -> int:
        """Have a stoppable job's ranks all stop before iteration N, `ahead` past the last progress rank 0
        published (`testbed.workloads.stop_file`); returns N."""
        assert self.stop_file is not None, f"job {self.name} was not started stoppable"
        return request_stop(self.stop_file, ahead)

    def wait(self, timeout: float) -> int:
        """Its exit code; a job still running after `timeout` has its group killed and the wait fails."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"job {self.name} did not finish in {timeout}s; log tail:\n{self.output()[-3000:]}") from None

    def kill(self) -> None:
        """Kill its group if it still runs, and reap it and every rank it started: Horovod's ranks may sit in
        groups of their own and outlive horovodrun by a moment, long enough to write one more file."""
        if self.proc.poll() is None:
            try:
                ranks = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                ranks = []
            kill_group(self.proc)
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
            self.proc.wait()
            psutil.wait_procs(ranks, timeout=30)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def summaries(self) -> list[dict[str, Any]]:
        return rank_summaries(self.out)


GLOO_EXIT_ABORT = "terminate called without an active exception"


def exit_outcome(job: Job, timeout: float, ranks: int = 2) -> str:
    """How a DDP job ended: "ok"; "abort at exit" when torch's Gloo teardown aborted a rank after all `ranks`
    wrote their summaries (the script's last line: torch's at interpreter exit, never a failure of training);
    else "failed". A job still running after `timeout` is killed and the wait fails (`Job.wait`)."""
    if job.wait(timeout) == 0:
        return "ok"
    if len(job.summaries()) == ranks and GLOO_EXIT_ABORT in job.output():
        return "abort at exit"
    return "failed"


def rank_summaries(out: Path) -> list[dict[str, Any]]:
    """What each rank wrote to `OUT/rank*.json` (our workloads write one per rank), in rank order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def horovodrun(name: str, script: Path, tmp: Path, np: int = 2, args: tuple[str, ...] | list[str] = (),
               env: dict[str, str] | None = None, mpi: bool = False, out_flag: bool = True,
               cwd: Path | None = None, stoppable: bool = False) -> Job:
    """Start `horovodrun -np N` on localhost with Gloo (or MPI) running `script` (from a warm
    interpreter: `testbed.harness.warm_horovodrun`).

    `--out OUT` comes before `args` for our workloads; `out_flag=False` leaves it off for scripts
    that do not take it (someone else's, run through a launcher given as `script`). The checkout
    is on the ranks' PYTHONPATH because the shared workloads import `testbed`, which is never installed.
    `stoppable`: `--stop-file` goes after `args` (our workloads), so `Job.stop()` can end the run early.
    """
    out = tmp / f"out_{name}"
    log = tmp / f"{name}.log"
    full_env = {**os.environ, "CROSSOVER_JOB_NAME": name, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = checkout_on_path(full_env)
    if mpi:
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["-np", str(np), "-H", f"localhost:{np}", "--mpi" if mpi else "--gloo"]
    if mpi:
        cmd += ["--mpi-args=--oversubscribe"]
    stop = tmp / f"stop_{name}" if stoppable else None
    cmd += [sys.executable, str(script), *(["--out", str(out)] if out_flag else []), *args,
            *(["--stop-file", str(stop)] if stop else [])]
    proc = start_horovodrun(cmd, env=full_env, log=log, cwd=cwd)
    return Job(name, proc, out, log, stop_file=stop)


def torchrun(name: str, script: Path, tmp: Path, nproc: int = 2, args: tuple[str, ...] | list[str] = (),
             env: dict[str, str] | None = None, stoppable: bool = False,
             launcher_args: tuple[str, ...] = ("--standalone",)) -> Job:
    """Start `torchrun --nproc-per-node N` (standalone rendezvous by default) running `script` with `--out OUT`
    and `args`, as `horovodrun` does for Horovod; Gloo is the workloads' backend."""
    out = tmp / f"out_{name}"
    log = tmp / f"{name}.log"
    full_env = {**os.environ, "CROSSOVER_JOB_NAME": name, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = checkout_on_path(full_env)
    stop = tmp / f"stop_{name}" if stoppable else None
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "--nproc-per-node", str(nproc),
           str(script), "--out", str(out), *args,
           *(["--stop-file", str(stop)] if stop else [])]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=full_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(name, proc, out, log, stop_file=stop)


def with_import(tmp: Path, script: str | Path = "train_mlp.py", prelude: str = "") -> Path:
    """A copy of a workload (a name in testbed/workloads, or a path) with `import crossover.auto` as its
    first line and `prelude` after it, nothing else changed."""
    src = Path(script) if Path(script).is_absolute() else WORKLOADS / script
    out = tmp / f"xo_{src.name}"
    out.write_text("import crossover.auto\n" + prelude + src.read_text())
    return out
