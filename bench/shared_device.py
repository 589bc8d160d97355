"""Jobs whose ranks all share one CPU device, as a new user would first run Crossover.

Two-rank `horovodrun` jobs (`testbed/workloads/train_mlp.py`, with `--metric`: every
rank allreduces its loss after every step, as Horovod's examples do) on one real
`crossoverd --cpu-devices 1`, alone and two side by side, under each mode:

  unscheduled  policy `passthrough` (the plugin only observes)
  crossover    policy `crossover` with grants everywhere (`--no-adapt`)
  adaptive     policy `crossover` as it ships (`--adapt`): grants only where they pay

Each cycle runs every mode once, in turn, so the modes share the machine's
state; the figure is each job's iterations/s over the middle half of its run,
summed over jobs, and divided by unscheduled's in the same cycle.

    python -m bench.shared_device [--cycles 2] [--iters 1500] [--out results/shared_device.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.results import git_commit, machine, write_json
from crossover.protos.event_file import typed
from crossover.protos.event_records import Sharing
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import horovodrun, with_import

MODES: dict[str, tuple[str, ...]] = {
    "unscheduled": ("--policy", "passthrough"),
    "crossover": ("--policy", "crossover", "--no-adapt"),
    "adaptive": ("--policy", "crossover", "--adapt"),
}
LAYOUTS = {"alone": 1, "together": 2}


def middle_rate(iter_times: list[float]) -> float:
    """Iterations per second over the middle half of a rank's iterations."""
    n = len(iter_times)
    mid = iter_times[n // 4: n - n // 4]
    return len(mid) / sum(mid) if mid and sum(mid) > 0 else 0.0


def run_once(mode: str, jobs: int, iters: int, window_s: float, workdir: Path) -> dict[str, Any]:
    """One daemon, `jobs` two-rank jobs to the end; each job's rate (rank 0's) and the daemon's verdicts."""
    daemon = DaemonProc.in_dir(workdir, "--cpu-devices", "1", *MODES[mode], "--adapt-window", str(window_s)).start()
    try:
        script = with_import(workdir)
        env = {"CROSSOVER_SOCKET": str(daemon.socket)}
        started = [horovodrun(f"job{i}", script, workdir, np=2, args=("--iters", str(iters), "--metric"), env=env)
                   for i in range(jobs)]
        for job in started:
            if job.wait(900) != 0:
                raise RuntimeError(f"{job.name} failed under {mode}: {job.output()[-2000:]}")
        rates = [middle_rate(job.summaries()[0]["iter_times"]) for job in started]
        verdicts = [Sharing.of(e) for e in typed(daemon.events()) if e.name is Sharing.name]
        sharing = [(v.mode, v.reason) for v in verdicts]
        return {"rates": rates, "sum": sum(rates), "sharing": sharing}
    finally:
        daemon.stop()


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout and mode: the summed rate of each cycle, and its ratio to unscheduled's in that cycle."""
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        base = {r["cycle"]: r["sum"] for r in runs if r["layout"] == layout and r["mode"] == "unscheduled"}
        rows = {}
        for mode in MODES:
            mine = [r for r in runs if r["layout"] == layout and r["mode"] == mode]
            ratios = [r["sum"] / base[r["cycle"]] for r in mine if base.get(r["cycle"])]
            rows[mode] = {"sums": [r["sum"] for r in mine], "vs_unscheduled": ratios,
                          "median_vs_unscheduled": statistics.median(ratios) if ratios else None}
        out[layout] = rows
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["layout    mode          it/s (per cycle)        vs unscheduled (per cycle)   median"]
    for layout, rows in summary.items():
        for mode, row in rows.items():
            sums = ", ".join(f"{s:.1f}" for s in row["sums"])
            ratios = ", ".join(f"{r:.3f}" for r in row["vs_unscheduled"])
            med = row["median_vs_unscheduled"]
            lines.append(f"{layout:<9} {mode:<13} {sums:<23} {ratios:<28} {med:.3f}" if med is not None
                         else f"{layout:<9} {mode:<13} {sums}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=2, help="times every mode runs (default 2)")
    p.add_argument("--iters", type=int, default=1500, help="iterations per job (default 1500)")
    p.add_argument("--adapt-window", type=float, default=1.0, help="crossoverd --adapt-window (default 1 s)")
    p.add_argument("--out", default="", help="write the runs and the summary here as JSON")
    args = p.parse_args(argv)
    if args.cycles < 1 or args.iters < 40:
        p.error("--cycles must be >= 1 and --iters >= 40")
    runs = []
    started = time.monotonic()
    total = args.cycles * len(LAYOUTS) * len(MODES)
    with tempfile.TemporaryDirectory(prefix="xo-shared-") as tmp:
        for cycle in range(args.cycles):
            for layout, jobs in LAYOUTS.items():
                for mode in MODES:
                    workdir = Path(tmp) / f"c{cycle}-{layout}-{mode}"
                    workdir.mkdir()
                    res = run_once(mode, jobs, args.iters, args.adapt_window, workdir)
                    runs.append({"cycle": cycle, "layout": layout, "mode": mode, **res})
                    print(f"[{len(runs)}/{total}, {time.monotonic() - started:.0f} s] cycle {cycle} {layout} {mode}: "
                          f"{res['sum']:.1f} it/s; verdicts {res['sharing'][-1:] or '-'}", file=sys.stderr)
    summary = summarise(runs)
    print(table(summary))
    if args.out:
        write_json(Path(args.out), {"benchmark": "shared_device", "machine": machine(), "commit": git_commit(),
                                    "args": vars(args), "runs": runs, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
