"""How often torch's Gloo teardown aborts a DDP rank at exit, with and without the plugin.

Pairs of co-located 2-rank `torchrun` jobs (`testbed/workloads/train_ddp.py
--no-destroy`: the script leaves its process group to the interpreter, as many do)
share one `--cpu-devices 1` device of a real crossoverd. A rank that aborts after
training ("terminate called without an active exception", SIGABRT) has already
written its results: the count is of such exits, and any other failure is reported
apart. Variants, alternated pair by pair so the machine's load hits both alike:

  plain    the script as it is, no import (the daemon idles)
  plugin   `import crossover.auto` first: the plugin destroys the process group at exit

    python -m bench.ddp_exit [--pairs 20] [--iters 40] [--out results/ddp_exit.json]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from bench.lib.results import machine, write_json
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import WORKLOADS, exit_outcome, torchrun, with_import

VARIANTS = ("plain", "plugin")


def run_pair(variant: str, workdir: Path, args: argparse.Namespace, k: int) -> list[str]:
    script = WORKLOADS / "train_ddp.py" if variant == "plain" else with_import(workdir, "train_ddp.py")
    with DaemonProc.in_dir(workdir, "--cpu-devices", "1", name=f"d_{variant}{k}") as d:
        env = {"CROSSOVER_SOCKET": str(d.socket)}
        jobs = [torchrun(f"{variant}{k}{side}", script, workdir, args=("--iters", str(args.iters), "--no-destroy"),
                         env=env) for side in "ab"]
        return [exit_outcome(job, args.timeout) for job in jobs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=20, help="pairs of jobs per variant")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a job may take")
    p.add_argument("--out", type=Path, default=Path("results/ddp_exit.json"))
    args = p.parse_args()
    outcomes: dict[str, list[str]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="xo-ddp-exit-") as tmp, Progress(transient=True) as progress:
        task = progress.add_task("pairs", total=args.pairs * len(VARIANTS))
        for k in range(args.pairs):
            for v in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
                progress.update(task, description=f"pair {k + 1}/{args.pairs}: {v}")
                outcomes[v] += run_pair(v, Path(tmp), args, k)
                progress.advance(task)
    summary = {v: {o: outcomes[v].count(o) for o in ("ok", "abort at exit", "failed")} | {"jobs": len(outcomes[v])}
               for v in VARIANTS}
    console = Console()
    for v, s in summary.items():
        console.print(f"{v:7s} {s['jobs']} jobs: {s['ok']} clean, {s['abort at exit']} aborted at exit after "
                      f"training, {s['failed']} failed")
    write_json(args.out, {"benchmark": "ddp_exit", "time": time.time(), "machine": machine(), "args": {
        "pairs": args.pairs, "iters": args.iters}, "summary": summary, "outcomes": outcomes})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
