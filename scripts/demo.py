"""`make demo`: a daemon, two co-located Horovod jobs with `import crossover.auto`, the queue, the result.

Runs on one machine: the daemon manages two CPU cores as devices, each job
has two ranks (one per device), so on every device the two jobs take turns.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tools.harness.daemon import BIN, DaemonProc, queue_state
from tools.harness.jobs import Job, horovodrun, with_import
from tools.harness.oracles import compute_intervals, overlaps

console = Console()
JOBS = ("resnet-ish", "bert-ish")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--policy", default="crossover", help="passthrough, exclusive or crossover")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crossover-demo-"))
    console.rule(f"[bold]Crossover demo[/] (work dir {tmp})")
    console.print(f"1. crossoverd --cpu-devices 2 --policy {args.policy}")
    daemon = DaemonProc.in_dir(tmp, "--cpu-devices", "2", "--policy", args.policy, "--log-level", "WARNING",
                               name="crossoverd")
    jobs: list[Job] = []
    try:
        try:
            daemon.start()
        except RuntimeError as exc:
            console.print(f"[red]{exc}[/]")
            return 1
        script = with_import(tmp, "train_mlp.py")
        console.print("2. two jobs, each `horovodrun -np 2 --gloo python train.py` with `import crossover.auto` "
                      "as its first line")
        t0 = time.monotonic()
        for name in JOBS:
            jobs.append(horovodrun(name, script, tmp, np=2, args=("--iters", str(args.iters)),
                                   env={"CROSSOVER_SOCKET": str(daemon.socket)}))
        console.print("3. `crossover queue` while they train:")
        shown = 0
        while any(j.proc.poll() is None for j in jobs) and shown < 3:
            time.sleep(2.5)
            try:
                state = queue_state(daemon.socket)
            except Exception:  # the daemon is busy or gone: the final check below says which
                continue
            if any(d["holders"] or d["waiting"] for d in state["devices"]):
                subprocess.run([str(BIN / "crossover"), "queue", "--socket", str(daemon.socket)], timeout=20)
                shown += 1
        for j in jobs:
            if j.proc.wait(600) != 0:
                console.print(f"[red]job {j.name} failed; see {j.log}[/]")
                return 1
        wall = time.monotonic() - t0
        console.print("4. result")
        table = Table()
        for c in ("job", "ranks", "iterations", "mean iter ms", "ranks agree"):
            table.add_column(c)
        for j in jobs:
            ranks = j.summaries()
            its = [t for r in ranks for t in r["iter_times"][5:]]
            table.add_row(j.name, str(len(ranks)), str(len(ranks[0]["iter_times"])),
                          f"{1000 * sum(its) / len(its):.1f}", str(len({r["digest"] for r in ranks}) == 1))
        console.print(table)
        ev = daemon.events()
        grants = [e for e in ev if e["event"] == "grant"]
        clashes = sum(len(overlaps(iv)) for iv in compute_intervals(ev).values())
        console.print(f"{len(grants)} grants over {wall:.1f}s; overlapping compute phases on a device: {clashes}; "
                      f"event log: {daemon.event_log}")
        return 0 if clashes == 0 or args.policy == "passthrough" else 1
    finally:
        for j in jobs:
            j.kill()
        daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
