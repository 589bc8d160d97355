"""`make demo`: a daemon, two co-located Horovod jobs with `import crossover.auto`, the queue, the result.

Runs on one machine: the daemon manages two CPU cores as devices, each job
has two ranks (one per device), so on every device the two jobs take turns.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKLOAD = ROOT / "tests" / "workloads" / "train_mlp.py"
console = Console()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--policy", default="crossover", help="passthrough, exclusive or crossover")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crossover-demo-"))
    sock, events = tmp / "crossoverd.sock", tmp / "events.jsonl"
    script = tmp / "train.py"
    script.write_text("import crossover.auto\n" + WORKLOAD.read_text())
    console.rule(f"[bold]Crossover demo[/] (work dir {tmp})")
    console.print(f"1. crossoverd --cpu-devices 2 --policy {args.policy}")
    daemon = subprocess.Popen([str(BIN / "crossoverd"), "--socket", str(sock), "--cpu-devices", "2",
                               "--policy", args.policy, "--event-log", str(events), "--log-level", "WARNING"],
                              start_new_session=True)
    jobs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 15
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                console.print("[red]crossoverd did not start[/]")
                return 1
            time.sleep(0.05)
        env = {**os.environ, "CROSSOVER_SOCKET": str(sock)}
        console.print("2. two jobs, each `horovodrun -np 2 --gloo python train.py` with `import crossover.auto` "
                      "as its first line")
        t0 = time.monotonic()
        for name in ("resnet-ish", "bert-ish"):
            out = tmp / name
            jobs.append(subprocess.Popen(
                [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script),
                 "--iters", str(args.iters), "--out", str(out)],
                env={**env, "CROSSOVER_JOB_NAME": name}, stdout=open(tmp / f"{name}.log", "wb"),
                stderr=subprocess.STDOUT, start_new_session=True))
        console.print("3. `crossover queue` while they train:")
        shown = 0
        while any(j.poll() is None for j in jobs) and shown < 3:
            time.sleep(2.5)
            state = subprocess.run([str(BIN / "crossover"), "queue", "--json", "--socket", str(sock)],
                                   capture_output=True, text=True)
            if state.returncode == 0 and any(d["holders"] or d["waiting"] for d in json.loads(state.stdout)["devices"]):
                subprocess.run([str(BIN / "crossover"), "queue", "--socket", str(sock)])
                shown += 1
        for j in jobs:
            if j.wait(600) != 0:
                console.print(f"[red]a job failed; see {tmp}[/]")
                return 1
        wall = time.monotonic() - t0
        console.print("4. result")
        table = Table()
        for c in ("job", "ranks", "iterations", "mean iter ms", "ranks agree"):
            table.add_column(c)
        for name in ("resnet-ish", "bert-ish"):
            ranks = [json.loads(f.read_text()) for f in sorted((tmp / name).glob("rank*.json"))]
            its = [t for r in ranks for t in r["iter_times"][5:]]
            table.add_row(name, str(len(ranks)), str(len(ranks[0]["iter_times"])),
                          f"{1000 * sum(its) / len(its):.1f}", str(len({r["digest"] for r in ranks}) == 1))
        console.print(table)
        ev = [json.loads(line) for line in events.read_text().splitlines()]
        grants = [e for e in ev if e["event"] == "grant"]
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import compute_intervals, overlaps

        clashes = sum(len(overlaps(iv)) for iv in compute_intervals(ev).values())
        console.print(f"{len(grants)} grants over {wall:.1f}s; overlapping compute phases on a device: {clashes}; "
                      f"event log: {events}")
        return 0 if clashes == 0 or args.policy == "passthrough" else 1
    finally:
        for j in jobs:
            if j.poll() is None:
                os.killpg(j.pid, signal.SIGKILL)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)


if __name__ == "__main__":
    sys.exit(main())
