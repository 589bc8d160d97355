"""The simulator fitted to GPU runs: which context-switch cost and hand-over cost reproduce what the GPU measured.

Reads the `gpu.json` files that `bench.gpu` wrote and simulates each run's
layout: J identical jobs, each with one rank on the GPU node (one device shared
by all of them) and one stand-in rank on the peer node. The stand-ins only wait
their compute time, so on the peer node each job gets a device of its own,
and never contends. Links are `fifo`, which is what the emulated cluster's
shaped links match. C and M are the run's own phase times with one job alone.

Two device parameters are swept, because no vendor publishes them:
  switch cost   k concurrent compute phases each run at 1/(k(1+p))
                (`SimConfig.switch_penalty`): what time-slicing between CUDA
                contexts costs;
  hand-over     added to each blocking compute phase (`grant_latency_s`): the
                grant's round trip and a job's kernels launched onto an idle
                GPU after the previous holder's work is done. A GPU run shows
                it as the scheduled compute phase's excess over alone.
For each point: exclusive and crossover as multiples of unscheduled, against
the measured medians; the best point is the one with the smallest largest miss.

    python -m bench.sim_vs_gpu results/gpu/h100_resnet18_b256_i288_*.json [--out results/sim_vs_gpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.results import machine, write_json
from tools.simulator import JobSpec, SimConfig, simulate

MODES = {"unscheduled": "passthrough", "exclusive": "exclusive", "crossover": "crossover"}
PENALTIES = (0.0, 0.04, 0.08, 0.12, 0.16, 0.2)
HANDOVERS_MS = (0.3, 2.0, 4.0, 6.0)


def run_of(path: Path) -> dict[str, Any]:
    """What the fit needs from one `bench.gpu` result: the layout, the phases alone, the measured ratios."""
    report = json.loads(path.read_text())
    speedup = report.get("checks", {}).get("speedup", {})
    summary = speedup.get("summary")
    if not summary:
        raise ValueError(f"{path}: no speed-up summary (did the speedup check run and pass?)")
    modes = summary["modes"]
    scheduled_c = [modes[m]["C_ms"] for m in ("exclusive", "crossover") if modes[m].get("C_ms")]
    return {"file": str(path), "scenario": summary["scenario"], "jobs": int(summary["jobs"]),
            "C_s": summary["alone_C_ms"] / 1000, "M_s": summary["alone_M_ms"] / 1000,
            "measured": {m: modes[m]["vs_unscheduled"] for m in ("exclusive", "crossover")},
            "scheduled_C_excess_ms": statistics.fmean(scheduled_c) - summary["alone_C_ms"] if scheduled_c else None}


def simulate_run(run: dict[str, Any], penalty: float, handover_s: float, seeds: int, iterations: int
                 ) -> dict[str, float]:
    """Each mode's throughput (iterations/s, mean over seeds) for the run's layout at one device point."""
    out: dict[str, float] = {}
    for mode, policy in MODES.items():
        rates = []
        for seed in range(seeds):
            jobs = [JobSpec(f"job{k}", ((0, 0), (1, k)), (run["C_s"], run["C_s"]), run["M_s"], iterations=iterations,
                            jitter=0.05) for k in range(run["jobs"])]
            cfg = SimConfig(seed=seed, switch_penalty=penalty, grant_latency_s=handover_s, startup_spread_s=0.5,
                            link_sharing="fifo")
            rates.append(simulate(jobs, policy, n_nodes=2, devices_per_node=run["jobs"], config=cfg).throughput_iter_s)
        out[mode] = statistics.fmean(rates)
    return {m: out[m] / out["unscheduled"] for m in ("exclusive", "crossover")}


def fit(runs: list[dict[str, Any]], penalties: tuple[float, ...], handovers_ms: tuple[float, ...], seeds: int,
        iterations: int) -> dict[str, Any]:
    """Every grid point's predictions and largest miss; the point with the smallest one."""
    points = []
    for p in penalties:
        for h in handovers_ms:
            predicted = [simulate_run(r, p, h / 1000, seeds, iterations) for r in runs]
            miss = max(abs(pred[m] - r["measured"][m]) for r, pred in zip(runs, predicted) for m in pred)
            points.append({"switch_penalty": p, "handover_ms": h, "predicted": predicted, "largest_miss": miss})
    return {"points": points, "best": min(points, key=lambda pt: pt["largest_miss"])}


def _pair(a: float, b: float) -> str:
    return f"{a:.3f}" if abs(a - b) < 0.0005 else f"{a:.3f}/{b:.3f}"


def _table(runs: list[dict[str, Any]], result: dict[str, Any]) -> Table:
    t = Table(title="exclusive/crossover x unscheduled")
    t.add_column("switch")
    t.add_column("hand-over", justify="right")
    for k, r in enumerate(runs, 1):
        t.add_column(f"#{k} x{r['jobs']}", justify="right")
    t.add_column("miss", justify="right")
    t.add_row("GPU", "", *[f"{r['measured']['exclusive']:.2f}/{r['measured']['crossover']:.2f}" for r in runs], "",
              end_section=True)
    for pt in result["points"]:
        cells = [_pair(pred["exclusive"], pred["crossover"]) for pred in pt["predicted"]]
        t.add_row(f"{pt['switch_penalty']:.2f}", f"{pt['handover_ms']:g} ms", *cells, f"{pt['largest_miss']:.3f}",
                  style="bold" if pt is result["best"] else None)
    return t


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="gpu.json files from bench.gpu")
    p.add_argument("--penalties", type=_floats, default=PENALTIES, help="switch costs to try, e.g. 0,0.1,0.2")
    p.add_argument("--handover-ms", type=_floats, default=HANDOVERS_MS, help="hand-over costs to try, ms")
    p.add_argument("--seeds", type=int, default=4, help="simulator seeds per point and mode")
    p.add_argument("--iterations", type=int, default=150, help="simulated iterations per job")
    p.add_argument("--out", type=Path, help="write the fit here as JSON")
    args = p.parse_args(argv)
    try:
        runs = [run_of(path) for path in args.results]
    except (OSError, ValueError, KeyError) as exc:
        print(f"bench.sim_vs_gpu: error: {exc}", file=sys.stderr)
        return 2
    result = fit(runs, args.penalties, args.handover_ms, args.seeds, args.iterations)
    console = Console()
    for k, r in enumerate(runs, 1):
        console.print(f"#{k} {r['file']}: {r['jobs']} jobs, alone C {1000 * r['C_s']:.0f} ms / M {1000 * r['M_s']:.0f} "
                      f"ms; measured exclusive {r['measured']['exclusive']:.3f}, crossover "
                      f"{r['measured']['crossover']:.3f} x unscheduled")
    console.print(_table(runs, result))
    best = result["best"]
    excess = ", ".join(f"{r['scheduled_C_excess_ms']:.1f}" for r in runs if r["scheduled_C_excess_ms"] is not None)
    console.print(f"best fit: switch cost {best['switch_penalty']:.2f}, hand-over {best['handover_ms']:g} ms, "
                  f"largest miss {best['largest_miss']:.3f}. Scheduled compute phases ran {excess} ms longer than "
                  f"alone (the median over both nodes; the stand-in node adds little, so the GPU node's own "
                  f"excess is larger).")
    if args.out:
        write_json(args.out, {"benchmark": "sim_vs_gpu", "time": time.time(), "machine": machine(),
                              "args": {**vars(args), "results": [str(x) for x in args.results], "out": str(args.out)},
                              "runs": runs, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
