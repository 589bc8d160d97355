"""Convergence on real data: LB-BSP + weighted aggregation vs synchronous Horovod with a straggler,
and Adasum vs averaging at 8x the global batch. 4 ranks under `horovodrun --gloo`, fixed seeds.

Scenarios (per dataset/model pair, all runs of one dataset in one 4-rank job, so
its start-up cost is paid once; a one-epoch warm-up run goes first):

* straggler: rank 3 runs 3x slower (`testbed.faults`, factor
  3.0). `sync` = plain synchronous Horovod (even split of each global batch,
  averaging); `lbbsp` = `CROSSOVER_AGGREGATION=weighted` with the LB-BSP
  sampler. Both train on the same global batches in the same order, so per
  epoch they make the same updates; what differs is wall-clock time. Reported:
  time to the target test accuracy, and final accuracy after the same epochs as
  the mean of the last epoch's evaluations (single ones differ by points).
  The target sits where the curve flattens (95-99% of the final accuracy,
  time-to-train style); the time to an early target (`early_target`, reached in
  the first third of the run, where the controller's first ~17 steps at the even
  split weigh most) and the step time once sizes settled (the run's second half)
  are reported beside it. A repeat's sync and LB-BSP runs train interleaved,
  a few steps of each in turn, each on its own clock (so the machine's drifting
  speed hits both alike). Time to target is judged with machine stalls capped
  (no evaluation interval counts more than 3x the run's median time per step;
  such stalls hit sync and LB-BSP runs alike, often both runs of a pair at
  once), the raw ratio beside it; ratios are taken per repeat and the median
  over repeats is checked.
* no_straggler: the same pair without a straggler (LB-BSP must not cost time),
  judged on training time with machine stalls capped: it fails when the mean
  cost over repeats, less twice its standard error, is above 3% (slower beyond
  this machine's noise); the raw time is reported beside it.
  `--rejudge RESULTS.json` applies the current checks to a saved run.
* large_batch: averaging and Adasum (the plugin's, since Gloo has no native
  Adasum) at 8x the baseline global batch with the baseline's learning rate
  (`--base-reference` also trains at the baseline batch). Reported: epochs to
  the target accuracy. Not paced: only epochs matter here.

Device emulation (`--pace`, see testbed/workloads/train_classifier.py): this
machine has fewer cores than ranks, so each rank's compute phase is stretched
to `pace x` its CPU time, making every rank behave like an independent device;
`auto` derives the factor from the load average before each job (other
processes on the machine slow every rank down too). The straggler's extra time
is a proportional sleep (`--straggler-work sleep`) for the same reason.
`--straggler-work busy --pace 0` runs the raw, unemulated variant.

    python -m bench.convergence [--quick] [--out results/convergence]
    python -m bench.convergence --only straggler:mnist1d-cnn [--repeats 8] [--also-method numerical]
    python -m bench.convergence --rejudge results/convergence.json

Writes `<out>.json` and `<out>_<scenario>_<dataset>-<model>.png`, prints a table.
What runs is planned in `bench.convergence.plan`, run by `bench.convergence.run`, judged by
`bench.convergence.judge` and drawn by `bench.convergence.plot`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from bench.convergence.judge import compare, steady_time_to_target_s, steady_train_s
from bench.convergence.plan import FULL, QUICK, STRAGGLER, pair, plan
from bench.convergence.plot import plots
from bench.convergence.run import loadavg, run_jobs
from bench.lib.judge import verdicts
from bench.lib.results import ROOT, git_commit, machine, write_json


def _fmt(value: Optional[float], unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def table(results: dict[str, Any]) -> Table:
    """One row per run: its figures, as the results file holds them."""
    t = Table(title="Convergence, 4 ranks (horovodrun --gloo)")
    for column in ("scenario", "data-model", "method", "#", "aggregation", "pace", "target", "final acc", "train s",
                   "time to target", "epochs to target", "final sizes"):
        t.add_column(column)
    for r in results.values():
        t.add_row(r["scenario"], r["pair"], r["method"], str(r["repeat"]), str(r["aggregation"]),
                  _fmt(r.get("pace"), "x"), f"{r['target']:.2f}",
                  f"{r['final_acc']:.4f}", _fmt(r["train_s"]), _fmt(r["time_to_target_s"], " s"),
                  _fmt(r["epochs_to_target"], "", 2), str(r["final_sizes"] or ""))
    return t


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small pair per scenario, fewer epochs (a few minutes)")
    p.add_argument("--out", default="", help="output stem (default results/convergence[_quick])")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--only", default="", help="comma-separated scenario:pair subset, e.g. "
                   "straggler:mnist1d-cnn,no_straggler:mnist1d-cnn (default: everything)")
    p.add_argument("--pace", default="auto", help="device emulation factor (0 disables it) or 'auto' (from load)")
    p.add_argument("--base-reference", action="store_true", help="also train at the baseline batch (slow)")
    p.add_argument("--keep", action="store_true", help="keep the job logs and per-rank outputs (temp dir)")
    p.add_argument("--straggler-work", choices=["sleep", "busy"], default="sleep")
    p.add_argument("--period", type=int, default=5, help="LB-BSP controller period")
    p.add_argument("--method", choices=["ema", "numerical"], default="ema", help="LB-BSP speed model")
    p.add_argument("--also-method", choices=["ema", "numerical"],
                   help="also run LB-BSP with this speed model in each straggler repeat, beside the checked one "
                        "(reported as lbbsp-METHOD, ratios against the same repeat's sync run)")
    p.add_argument("--ema-alpha", type=float, default=0.1,
                   help="LB-BSP speed smoothing (timings on a loaded shared machine are noisy)")
    p.add_argument("--repeats", type=int, default=0,
                   help="repeats of each straggler and no-straggler pair (default: 5 quick, 2 full)")
    p.add_argument("--rejudge", type=Path, metavar="RESULTS_JSON",
                   help="run nothing: apply the current checks to a saved run's results and print them")
    args = p.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)
    if args.rejudge:
        sys.exit(rejudge(args.rejudge, console))
    stem = Path(args.out or ("results/convergence_quick" if args.quick else "results/convergence"))
    if not stem.is_absolute():
        stem = ROOT / stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    config = QUICK if args.quick else FULL
    if args.only:
        wanted = {item.strip() for item in args.only.split(",") if item.strip()}
        known = [f"{sc}:{pair(e)}" for group, entries in config.items() for e in entries
                 for sc in (("straggler", "no_straggler") if group == "straggler" else (group,))]
        unknown = sorted(wanted - set(known))
        if unknown:
            p.error(f"--only {','.join(unknown)!r} matches nothing; choose from {', '.join(sorted(known))}")
        config = {
            "straggler": [{**e, "scenarios": tuple(sc for sc in ("straggler", "no_straggler")
                                                   if f"{sc}:{pair(e)}" in wanted)}
                          for e in config["straggler"]
                          if {f"straggler:{pair(e)}", f"no_straggler:{pair(e)}"} & wanted],
            "large_batch": [e for e in config["large_batch"] if f"large_batch:{pair(e)}" in wanted],
        }
    args.repeats = args.repeats or (5 if args.quick else 2)
    jobs = plan(config, args)
    load_before = loadavg()
    started = time.monotonic()
    results = run_jobs(jobs, args, console)
    paces = results.pop("paces")
    elapsed = time.monotonic() - started
    checks = compare(results)
    pngs = plots(results, stem)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    write_json(stem.with_suffix(".json"), {
        "version": 1, "command": command, "machine": machine(), "load_before": load_before,
        "load_after": loadavg(), "elapsed_s": elapsed, "ranks": args.np, "pace": args.pace, "paces": paces,
        "straggler": STRAGGLER, "straggler_work": args.straggler_work, "period": args.period,
        "method": args.method, "ema_alpha": args.ema_alpha, "repeats": args.repeats, "config": config,
        "git": git_commit(), "results": results,
        "checks": checks, "plots": pngs,
    })
    console.print(table(results))
    console.print(verdicts(checks))
    console.print(f"{stem.with_suffix('.json')}\n" + "\n".join(pngs))
    console.print(f"{elapsed:.0f} s on {os.cpu_count()} CPUs; load average before {load_before}, after {loadavg()}")


def rejudge(path: Path, console: Console) -> int:
    """Print the current checks on a saved run (figures added since it ran are computed from its curves).
    Exit status 0 when every check is met, 1 when one is not, 2 when the file is not a results file."""
    try:
        saved = json.loads(path.read_text())
        results = saved["results"]
        for run in results.values():
            if "steady_train_s" not in run:
                run["steady_train_s"] = steady_train_s(run["curve"])
            if "steady_time_to_target_s" not in run:
                run["steady_time_to_target_s"] = steady_time_to_target_s(run["curve"], run["target"])
        checks = compare(results)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        console.print(f"error: {path} is not a bench/convergence/ results file: {exc!r}")
        return 2
    console.print(verdicts(checks, f"Targets, rejudged: {path} (ran at {saved.get('git') or 'unknown commit'})"))
    return 0 if all(row["met"] is not False for row in checks) else 1

