"""Running the convergence benchmark: one 4-rank `horovodrun` job per dataset that trains its planned runs
one after another (testbed/workloads/train_classifier.py), paced to emulate independent devices."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.convergence.judge import summarise
from bench.lib.jobs import finish_job, start_job
from testbed.harness.jobs import WORKLOADS

WORKLOAD = WORKLOADS / "train_classifier.py"
_MIN_PACE = 6.0  # see choose_pace


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages; [] where /proc/loadavg cannot be read."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run_jobs(jobs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, console: Console) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="crossover-convergence-"))
    try:
        return _run_jobs(jobs, args, console, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def choose_pace(args: argparse.Namespace) -> float:
    """``--pace auto``: stretch compute phases beyond what the current load makes them take.

    With ``L`` runnable processes besides our ``n`` ranks on ``c`` cores, a
    rank gets about ``c / (L + n)`` of a core, so its compute phase takes
    about ``(L + n) / c`` times its CPU time; pacing to 1.25x that keeps the
    phase length a function of the rank's own work. At least 6x: the
    allreduce, the optimizer step and the data loading are not paced and need
    the CPU too; below about 6x they take a large share of a settled LB-BSP
    step and the emulated devices are not independent.
    """
    if args.pace != "auto":
        return float(args.pace)
    load = loadavg()
    others = load[0] if load else 0.0
    return round(max(_MIN_PACE, 1.25 * (others + args.np) / (os.cpu_count() or 1)), 1)


def _run_jobs(jobs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, console: Console,
              workdir: Path) -> dict[str, Any]:
    data_cache = workdir / "mnist1d.npz"
    results: dict[str, Any] = {"paces": {}}
    paces = results["paces"]
    total = sum(len(runs) for runs in jobs.values())
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("convergence", total=total)
        done_before = 0
        for dataset, runs in jobs.items():
            progress.update(task, description=f"{dataset}: starting 4 ranks")
            specs = workdir / f"{dataset}.runs.json"
            specs.write_text(json.dumps(runs))
            pace = choose_pace(args)
            paces[dataset] = pace
            proc, out = start_job(dataset, WORKLOAD, workdir, args.np,
                                  ["--dataset", dataset, "--data", str(data_cache), "--runs", f"@{specs}",
                                   "--pace", str(pace)], {"PYTHONUNBUFFERED": "1"})
            log = workdir / f"{dataset}.log"
            while proc.poll() is None:
                text = log.read_text(errors="replace") if log.exists() else ""
                finished = text.count("]<stdout>:run ")
                current = runs[min(finished, len(runs) - 1)]["name"]
                progress.update(task, completed=done_before + finished, description=f"{dataset}: {current}")
                time.sleep(1.0)
            try:
                ranks = finish_job(proc, out, timeout=10)
            except RuntimeError:
                console.print(f"[red]job {dataset} failed; log tail:[/red]\n{log.read_text(errors='replace')[-3000:]}")
                raise
            done_before += len(runs)
            progress.update(task, completed=done_before)
            for run in ranks[0]["runs"]:
                if run["spec"]["scenario"] != "warmup":
                    results[run["name"]] = summarise(run)
                    results[run["name"]]["pace"] = run["spec"]["pace"] if run["spec"]["pace"] is not None else pace
    return results

