"""The isolation controller on the CPU bed: a production job beside a low one on one device, side by side.

Two 2-rank Horovod jobs (`testbed/workloads/train_mlp.py` with `import crossover.auto`) whose four ranks share
one CPU device of a real crossoverd (`--cpu-devices 1`), as a new user would try priorities. One cycle runs, in
a rotated order, each mode for a segment of `--segment` seconds after `--settle` seconds of warm-up (the
production job starts `--settle`/2 seconds before the low job, as it would be running before a low job came):

  alone        each job by itself (its speed alone: the reference of every ratio)
  unscheduled  both, no grants (passthrough: time-slicing by the kernel)
  equal        both in one class (the crossover policy)
  classes      the low job in class `low`, the open-loop class rules alone (`crossoverd --protect 0`)
  protect      the same with the isolation controller holding the production job at `--protect`

A job's speed in a segment is its rank 0's allreduces ended per second, from the daemon's event log. The
table gives each job's speed relative to alone (median over cycles, each cycle's in brackets), the low job's
against `low_ceiling` (1 minus the production job's compute share alone: the most a low job can get while
the production job stays whole), and the controller's budget at the end of each protect segment.

    python -m bench.isolation [--cycles 3] [--segment 20] [--out results/isolation_cpu.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.results import machine, write_json
from crossover.protos.event_file import Event, EventName
from crossover.protos.event_records import Isolation, Release
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import Job, horovodrun, with_import

MODES = ("unscheduled", "equal", "classes", "protect")
_FLAGS = {"alone": ("--policy", "crossover"), "unscheduled": ("--policy", "passthrough"),
          "equal": ("--policy", "crossover"), "classes": ("--policy", "crossover", "--protect", "0"),
          "protect": ("--policy", "crossover")}


def _speed(events: list[Event], job: str, t0: float, t1: float) -> float:
    """Rank 0's allreduces of `job` ended per second within [t0, t1]."""
    ends = [e.t for e in events if e.name is EventName.COMM_END and e.job_name == job and e.rank == 0
            and t0 <= e.t <= t1]
    return len(ends) / (t1 - t0)


def _compute_share(events: list[Event], job: str, t0: float, t1: float) -> float:
    """The share of wall time `job`'s rank 0 held the device within [t0, t1]."""
    held = sum(Release.of(e).held_s or 0.0 for e in events if e.name is EventName.RELEASE and e.job_name == job
               and e.rank == 0 and t0 <= e.t <= t1)
    return held / (t1 - t0)


def _segment(tmp: Path, mode: str, jobs: tuple[str, ...], args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Run `jobs` together under `mode` for one segment; each job's speed, and what the daemon logged."""
    flags = _FLAGS[mode] + ("--protect", f"{args.protect:g}") if mode == "protect" else _FLAGS[mode]
    with DaemonProc.in_dir(tmp, "--cpu-devices", "1", *flags, name=f"d-{tag}") as d:
        started: list[Job] = []
        try:
            for job in jobs:
                env = {"CROSSOVER_SOCKET": str(d.socket)}
                if args.host_cores:
                    env["CROSSOVER_HOST_CORES"] = args.host_cores
                if job == "low" and mode in ("classes", "protect"):
                    env["CROSSOVER_PRIORITY"] = "low"
                if job == "low" and args.low_cycle_ms:
                    env["HOROVOD_CYCLE_TIME"] = f"{args.low_cycle_ms:g}"
                if started:  # the production job trains alone a while first, as it would before a low job came
                    time.sleep(args.settle / 2)
                started.append(horovodrun(f"{job}-{tag}", with_import(tmp), tmp, np=2, stoppable=True, env=env,
                                          args=("--iters", "1000000", "--width", str(args.width),
                                                "--batch", str(args.batch))))
            time.sleep(args.settle + args.segment)
            events = d.events()
            t1 = max(e.t for e in events)
            t0 = t1 - args.segment
            out: dict[str, Any] = {job: _speed(events, f"{job}-{tag}", t0, t1) for job in jobs}
            if mode == "alone" and "prod" in jobs:
                out["prod_compute_share"] = _compute_share(events, f"prod-{tag}", t0, t1)
            budgets = [Isolation.of(e) for e in events if e.name is EventName.ISOLATION]
            if budgets:
                out["budget"] = budgets[-1].budget
                out["isolation_events"] = len(budgets)
            for j in started:
                j.stop()
            for j in started:
                j.wait(60)
        finally:
            for j in started:
                j.kill()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--segment", type=float, default=20.0, help="seconds measured per mode")
    p.add_argument("--settle", type=float, default=10.0, help="seconds of warm-up before each segment (the "
                   "controller's first solo window among them)")
    p.add_argument("--protect", type=float, default=0.97, help="crossoverd --protect in the protect mode")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--host-cores", default="", help="CROSSOVER_HOST_CORES for every rank (e.g. 1): the ranks' "
                   "other threads (Horovod's background loop, Gloo) on these cores, as a GPU leaves the host's "
                   "cores to them; default: every thread on the device's core")
    p.add_argument("--low-cycle-ms", type=float, default=0.0, help="HOROVOD_CYCLE_TIME for the low job, in every "
                   "mode (its background loop's cycle: each cycle coordinates the job's ranks, on the host's cores)")
    p.add_argument("--out", type=Path, default=Path("results/isolation_cpu.json"))
    args = p.parse_args()

    cycles: list[dict[str, Any]] = []
    order = ("alone", *MODES)
    with tempfile.TemporaryDirectory(prefix="xo-isolation-") as tmp:
        for c in range(args.cycles):
            rotated = order[c % len(order):] + order[:c % len(order)]
            cycle: dict[str, Any] = {}
            for mode in rotated:
                print(f"cycle {c + 1}/{args.cycles}: {mode}", file=sys.stderr, flush=True)
                if mode == "alone":
                    cycle["alone_prod"] = _segment(Path(tmp), "alone", ("prod",), args, f"{c}a")
                    cycle["alone_low"] = _segment(Path(tmp), "alone", ("low",), args, f"{c}b")
                else:
                    cycle[mode] = _segment(Path(tmp), mode, ("prod", "low"), args, f"{c}{mode}")
            cycles.append(cycle)

    rows: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        prod = [c[mode]["prod"] / c["alone_prod"]["prod"] for c in cycles]
        low = [c[mode]["low"] / c["alone_low"]["low"] for c in cycles]
        ceiling = [1 - c["alone_prod"]["prod_compute_share"] for c in cycles]
        rows[mode] = {"prod": prod, "low": low, "low_ceiling": ceiling,
                      "low_of_ceiling": [lo / ce if ce > 0 else None for lo, ce in zip(low, ceiling)],
                      "budget": [c[mode].get("budget") for c in cycles]}
    t = Table(title=f"isolation, CPU bed: two 2-rank jobs on one --cpu-devices 1 device"
                    f"{f', other threads on cores {args.host_cores}' if args.host_cores else ''}, {args.cycles} "
                    f"cycles of {args.segment:g} s segments (speed relative to alone)")
    for col in ("mode", "production", "low", "low / low_ceiling", "budget (s/s)"):
        t.add_column(col, justify="right")

    def cell(xs: list[Any]) -> str:
        xs = [x for x in xs if x is not None]
        return "-" if not xs else f"{statistics.median(xs):.2f} ({', '.join(f'{x:.2f}' for x in xs)})"

    for mode, r in rows.items():
        t.add_row(mode, cell(r["prod"]), cell(r["low"]), cell(r["low_of_ceiling"]),
                  cell(r["budget"]) if mode == "protect" else "-")
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    write_json(args.out, {"benchmark": "isolation_cpu", "time": time.time(), "machine": machine(),
                          "args": {**vars(args), "out": str(args.out)}, "rows": rows, "cycles": cycles})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
