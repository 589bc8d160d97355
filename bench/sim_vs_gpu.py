"""The simulator fitted to GPU runs: which context-switch and hand-over costs reproduce what the GPU measured.

Reads the `gpu.json` files that `bench.gpu` wrote and simulates each run's
layout: J identical jobs, each with one rank on the GPU node (one device shared
by all of them) and one stand-in rank on the peer node. C and M are the run's
own phase times with one job alone.

The stand-ins get a device each in the simulation. On the bed they share the
peer node's one device, and in the scheduled modes its daemon grants it to one
at a time; but a stand-in sleeps until its iteration's start + C, so a grant
wait shortens its sleep and delays it only where the wait is longer than C.
Links are swept over both link models (`--links`): `fifo` is the one the
device-model bed matched (`bench.sim_vs_emulated`).

Two device parameters are swept, because no vendor publishes them:
  switch cost   k concurrent compute phases each run at 1/(k(1+p))
                (`SimConfig.switch_penalty`): what time-slicing between CUDA
                contexts costs;
  hand-over     added to each blocking compute phase (`grant_latency_s`): the
                grant's round trip, and a job's kernels launched onto an idle
                GPU after the previous holder's work is done.
Not modelled: interference between compute and the allreduce's host staging
copies on the GPU.

For each point: exclusive and crossover as multiples of unscheduled against
the measured medians (the table shows exclusive: with identical jobs the
simulated crossover matches it), each run's miss, and the largest; the best point is the
one with the smallest largest miss. Runs named with `--report` are simulated
at every point but left out of the fit.

    python -m bench.sim_vs_gpu results/gpu/h100_resnet18_b256_i288_*.json [--report OTHER.json ...]
        [--out results/sim_vs_gpu.json]
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
from testbed.simulator import LINK_SHARING, JobSpec, SimConfig, simulate

MODES = {"unscheduled": "passthrough", "exclusive": "exclusive", "crossover": "crossover"}
PENALTIES = (0.0, 0.04, 0.08, 0.12, 0.16, 0.2)
MEASURED_HANDOVER_MS = {"on the GPU": 0.14, "through the daemon": 0.65}
"""Median hand-over gaps that `bench.gpu --only handover` measured on an H200 (2026-11-27,
`results/gpu/h200_resnet18_b256_i288_x2.json`): a turn ended by the GPU itself, and today's path."""
HANDOVERS_MS = (*MEASURED_HANDOVER_MS.values(), 2.0, 4.0, 6.0, 8.0)


def run_of(path: Path) -> dict[str, Any]:
    """What the fit needs from one `bench.gpu` result: the layout, the phases alone, the measured ratios."""
    report = json.loads(path.read_text())
    summary = report.get("checks", {}).get("speedup", {}).get("summary")
    if not summary:
        raise ValueError(f"{path}: no speed-up summary (did the speedup check run and pass?)")
    modes = summary["modes"]
    return {"file": str(path), "scenario": summary["scenario"], "jobs": int(summary["jobs"]),
            "C_s": summary["alone_C_ms"] / 1000, "M_s": summary["alone_M_ms"] / 1000,
            "cycles": int(modes["crossover"].get("cycles", 0)),
            "measured": {m: modes[m]["vs_unscheduled"] for m in ("exclusive", "crossover")}}


def _throughput(run: dict[str, Any], policy: str, penalty: float, handover_s: float, links: str, seeds: int,
                iterations: int) -> float:
    """One mode's iterations/s for the run's layout at one point, the mean over seeds."""
    rates = []
    for seed in range(seeds):
        jobs = [JobSpec(f"job{k}", ((0, 0), (1, k)), (run["C_s"], run["C_s"]), run["M_s"], iterations=iterations,
                        jitter=0.05) for k in range(run["jobs"])]
        cfg = SimConfig(seed=seed, switch_penalty=penalty, grant_latency_s=handover_s, startup_spread_s=0.5,
                        link_sharing=links)
        rates.append(simulate(jobs, policy, n_nodes=2, devices_per_node=run["jobs"], config=cfg).throughput_iter_s)
    return statistics.fmean(rates)


def simulate_run(run: dict[str, Any], penalty: float, handover_s: float, links: str, seeds: int, iterations: int,
                 unscheduled: float | None = None) -> dict[str, float]:
    """Exclusive and crossover as multiples of unscheduled at one point. `unscheduled`: its iterations/s if
    known; a hand-over is added only to granted phases, so it is the same for every hand-over."""
    base = unscheduled if unscheduled is not None else _throughput(run, MODES["unscheduled"], penalty, handover_s,
                                                                    links, seeds, iterations)
    return {m: _throughput(run, MODES[m], penalty, handover_s, links, seeds, iterations) / base
            for m in ("exclusive", "crossover")}


def _miss(run: dict[str, Any], predicted: dict[str, float]) -> float:
    return max(abs(predicted[m] - run["measured"][m]) for m in predicted)


def fit(runs: list[dict[str, Any]], penalties: tuple[float, ...], handovers_ms: tuple[float, ...],
        links: tuple[str, ...], seeds: int, iterations: int, reported: tuple[dict[str, Any], ...] = ()
        ) -> dict[str, Any]:
    """Every point's predictions and misses (`runs` then `reported`); the point whose largest miss over `runs` is
    smallest."""
    if not runs or not penalties or not handovers_ms or not links or seeds < 1 or iterations < 1:
        raise ValueError("a fit needs at least one run, penalty, hand-over, link model, seed and iteration")
    points: list[dict[str, Any]] = []
    for link in links:
        for p in penalties:
            unscheduled = [_throughput(r, MODES["unscheduled"], p, 0.0, link, seeds, iterations)
                           for r in (*runs, *reported)]
            for h in handovers_ms:
                predicted = [simulate_run(r, p, h / 1000, link, seeds, iterations, base)
                             for r, base in zip((*runs, *reported), unscheduled)]
                misses = [_miss(r, pred) for r, pred in zip((*runs, *reported), predicted)]
                points.append({"links": link, "switch_penalty": p, "handover_ms": h, "predicted": predicted,
                               "misses": misses, "largest_miss": max(misses[:len(runs)])})
    return {"points": points, "best": min(points, key=lambda pt: pt["largest_miss"])}


def _table(runs: list[dict[str, Any]], result: dict[str, Any]) -> Table:
    t = Table(title="exclusive x unscheduled, measured and simulated")
    t.add_column("links, switch, hand-over")
    for k, r in enumerate(runs, 1):
        t.add_column(f"#{k} x{r['jobs']}", justify="right")
    t.add_column("miss", justify="right")
    t.add_row("measured on the GPU", *[f"{r['measured']['exclusive']:.3f}" for r in runs], "", end_section=True)
    for pt in result["points"]:
        t.add_row(f"{pt['links']} {pt['switch_penalty']:.2f} {pt['handover_ms']:g} ms",
                  *[f"{pred['exclusive']:.3f}" for pred in pt["predicted"]], f"{pt['largest_miss']:.3f}",
                  style="bold" if pt is result["best"] else None)
    return t


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one or more numbers >= 0")
    return values


def _links(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in values if v not in LINK_SHARING]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected link models from {', '.join(LINK_SHARING)}")
    return values


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="gpu.json files from bench.gpu: the runs to fit")
    p.add_argument("--report", nargs="*", type=Path, default=[], help="gpu.json files simulated but not fitted")
    p.add_argument("--penalties", type=_floats, default=PENALTIES, help="switch costs to try, e.g. 0,0.1,0.2")
    p.add_argument("--handover-ms", type=_floats, default=HANDOVERS_MS, help="hand-over costs to try, ms")
    p.add_argument("--links", type=_links, default=tuple(LINK_SHARING), help="link models to try (fifo,fair)")
    p.add_argument("--seeds", type=_positive, default=4, help="simulator seeds per point and mode")
    p.add_argument("--iterations", type=_positive, default=150, help="simulated iterations per job")
    p.add_argument("--out", type=Path, help="write the fit here as JSON")
    args = p.parse_args(argv)
    try:
        runs = [run_of(path) for path in args.results]
        reported = tuple(run_of(path) for path in args.report)
    except (OSError, ValueError, KeyError) as exc:
        print(f"bench.sim_vs_gpu: error: {exc}", file=sys.stderr)
        return 2
    result = fit(runs, args.penalties, args.handover_ms, args.links, args.seeds, args.iterations, reported)
    console = Console()
    everyone = [*runs, *reported]
    for k, r in enumerate(everyone, 1):
        console.print(f"#{k}{' (not fitted)' if k > len(runs) else ''} {r['file']}: {r['jobs']} jobs, "
                      f"{r['cycles']} cycles, alone C {1000 * r['C_s']:.0f} ms / M {1000 * r['M_s']:.0f} ms; measured "
                      f"exclusive {r['measured']['exclusive']:.3f}, crossover {r['measured']['crossover']:.3f}")
    console.print(_table(everyone, result))
    best = result["best"]
    console.print(f"best fit: {best['links']} links, switch cost {best['switch_penalty']:.2f}, hand-over "
                  f"{best['handover_ms']:g} ms; misses by run " + ", ".join(f"{m:.3f}" for m in best["misses"]))
    if args.out:
        write_json(args.out, {"benchmark": "sim_vs_gpu", "time": time.time(), "machine": machine(),
                              "args": {**vars(args), "results": [str(x) for x in args.results],
                                       "report": [str(x) for x in args.report], "out": str(args.out)},
                              "runs": runs, "reported": list(reported), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
