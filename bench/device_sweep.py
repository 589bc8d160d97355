"""Where scheduling pays on a GPU-like device: the device model's parameters swept in the simulator.

The emulated cluster's device model (`testbed.device_model`: time slices, a
context-switch cost, compute slowed beside an allreduce) has parameters that
no vendor publishes exactly (docs/emulated-cluster.md, "The device model").
`bench.sim_vs_emulated` checks the simulator against the emulated bed at the
measured point; this sweep then asks the simulator, which shares the model's
rate rule, how the policies compare across the plausible range:

  switch cost per slice  0.04 (40 µs per 1024 µs, save and restore only) up to
                         0.5 (what a working set that must be re-fetched after
                         every switch could cost);
  interference           0 (comm on the host, as with Gloo), 0.19 (the mean
                         published for NCCL beside compute), 0.4 (the maximum).

For each point and comm:compute ratio, two and three identical jobs on two
nodes (`simulate_small`, fifo links: what the emulated bed's links match):
crossover and exclusive as multiples of unscheduled.

    python -m bench.device_sweep [--iters 200] [--out results/device_sweep.json]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.results import machine, write_json
from testbed.simulator import simulate_small

SWITCH = (0.04, 0.1, 0.25, 0.5)
INTERFERENCE = (0.0, 0.19, 0.4)
RATIOS = {"1:2": 0.5, "1:1": 1.0, "2:1": 2.0}  # comm:compute
JOBS = (2, 3)
C_S = 0.15  # compute phase alone, as on the emulated bed (--iter-ms 300 at 1:1)


def point(switch: float, interference: float, ratio: float, jobs: int, iters: int) -> dict[str, Any]:
    """Throughput of each mode at one point, and crossover's and exclusive's ratio to unscheduled."""
    it = {mode: simulate_small(C_S, C_S * ratio, jobs, policy, switch_penalty=switch, interference=interference,
                               comm_interference=0.0, link_sharing="fifo", iterations=iters)["throughput_iter_s"]
          for mode, policy in (("unscheduled", "passthrough"), ("exclusive", "exclusive"),
                               ("crossover", "crossover"))}
    return {"switch_penalty": switch, "interference": interference, "ratio": ratio, "jobs": jobs, "iter_s": it,
            "crossover_vs_unscheduled": it["crossover"] / it["unscheduled"],
            "exclusive_vs_unscheduled": it["exclusive"] / it["unscheduled"],
            "crossover_vs_exclusive": it["crossover"] / it["exclusive"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200, help="simulated iterations per job")
    p.add_argument("--out", type=Path, default=Path("results/device_sweep.json"))
    args = p.parse_args()
    t0 = time.monotonic()
    rows = [point(s, x, r, j, args.iters)
            for s, x, (_, r), j in itertools.product(SWITCH, INTERFERENCE, RATIOS.items(), JOBS)]
    t = Table(title="crossover / unscheduled (exclusive / unscheduled) in the simulator with the device model; "
                    "2 nodes, fifo links", caption="rows: switch cost per slice, interference beside an allreduce; "
                                                   "columns: comm:compute, jobs per device")
    t.add_column("switch, interf.")
    for name, j in itertools.product(RATIOS, JOBS):
        t.add_column(f"{name} x{j}", justify="right")
    for s, x in itertools.product(SWITCH, INTERFERENCE):
        cells = []
        for name, j in itertools.product(RATIOS, JOBS):
            r = next(r for r in rows if (r["switch_penalty"], r["interference"], r["ratio"], r["jobs"])
                     == (s, x, RATIOS[name], j))
            cells.append(f"{r['crossover_vs_unscheduled']:.2f} ({r['exclusive_vs_unscheduled']:.2f})")
        t.add_row(f"{s:g}, {x:g}", *cells)
    Console(width=None if sys.stdout.isatty() else 140).print(t)
    write_json(args.out, {"benchmark": "device_sweep", "time": time.time(), "machine": machine(),
                          "elapsed_s": time.monotonic() - t0, "compute_s": C_S,
                          "args": {"iters": args.iters, "out": str(args.out)}, "points": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
