"""Cluster simulation: the daemon's policies on 64 nodes x 8 GPUs, and on the emulated cluster's small scenarios.

Large scenarios (`testbed.simulator`, one policy instance per node):
  static-k  k = 2, 3, 4 jobs per GPU. Jobs span 8-64 nodes with one GPU per node,
            placed so that different jobs share GPUs in different combinations.
            Each job has its own compute time C (30-70 ms) and comm:compute ratio
            (0.5-2), ranks differ by +-10%, every phase has lognormal jitter.
            All jobs start together (their ranks join within `--spread` s, so the
            order in which jobs join differs from node to node).
  uniform-3 static-3 with near-identical jobs (C = M = 50 ms, ranks +-5%): what
            placement alone costs, without heterogeneity.
  churn-3   the same at 3 jobs per GPU, but half the jobs arrive during the
            first 15 s, each runs 100-300 iterations, and 10% crash mid-run.
Policies: passthrough (unscheduled co-location: processor sharing with a
switch penalty), exclusive (FIFO per device), turns-nosync (the turn rotation
ordered by each node's local join order), turns and crossover (the default).

Heterogeneous scenarios (part of the default run; `--no-hetero` skips them): a few
jobs with different C and M on 3-4 nodes x 1 GPU, each spanning its own set of
nodes (job A on nodes 0-1, B on 1-2, ...), so every device has different partners:
  span-3        4 jobs on 3 nodes (3 per device)
  span-4        5 jobs on 4 nodes (3 per device)
  span-4-churn  span-4, plus a job that arrives at 2 s and one that leaves at 4 s
each with exact phases (jitter 0) and with jitter 0.1. For the static ones the
table also gives the share of an offline reference: the best fixed cyclic order
on every device, found by simulating every combination (`testbed.simulator.reference`).

Small scenarios (`--small`, or part of the default run): the emulated-cluster
benchmark's set, 2 nodes x 1 device, 2 and 3 identical jobs, comm:compute 1:1,
1:2, 2:1 with C = --compute-ms and M scaled from --comm-ms, through
`simulate_small` (also: `alone` and `sequential`).

    python -m bench.simulate [--small] [--iters 200] [--runs K] [--workers N] [--out results/simulate.json]
    python -m bench.simulate --pool results/simulate_fifo_runs_seed*.json   # several seeds' runs, pooled
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.lib.results import machine, write_json
from testbed.simulator import LINK_SHARING, POLICIES, SMALL_POLICIES, JobSpec, SimConfig, simulate, simulate_small
from testbed.simulator.reference import best_cyclic_orders, run_orders

N_NODES, GPUS = 64, 8
LARGE = ("static-2", "static-3", "static-4", "uniform-3", "churn-3")
SMALL_RATIOS = {"1:1": 1.0, "1:2": 0.5, "2:1": 2.0}  # comm:compute
HETERO = ("span-3", "span-4", "span-4-churn")
HETERO_POLICIES = ("exclusive", "turns", "crossover", "crossover-link")


def place_jobs(rng: random.Random, per_gpu: int,
               sizes: tuple[int, ...] = (8, 16, 32, 64)) -> list[list[tuple[int, int]]]:
    """Fill every GPU with `per_gpu` job slots; each job takes one GPU on each of 8-64 nodes."""
    free = {(n, g): per_gpu for n in range(N_NODES) for g in range(GPUS)}
    jobs: list[list[tuple[int, int]]] = []
    while True:
        open_nodes = [n for n in range(N_NODES) if any(free[(n, g)] for g in range(GPUS))]
        fitting = [s for s in sizes if s <= len(open_nodes)]
        if not fitting:
            return jobs
        size = rng.choice(fitting)
        # The emptiest nodes first, ties broken at random: jobs overlap in ever new combinations.
        nodes = sorted(open_nodes, key=lambda n: (-sum(free[(n, g)] for g in range(GPUS)), rng.random()))[:size]
        placement = []
        for n in sorted(nodes):
            g = max((g for g in range(GPUS) if free[(n, g)]), key=lambda g: (free[(n, g)], rng.random()))
            free[(n, g)] -= 1
            placement.append((n, g))
        jobs.append(placement)


def large_jobs(scenario: str, iters: int, seed: int) -> list[JobSpec]:
    rng = random.Random(f"{scenario}/{seed}")
    per_gpu = int(scenario.rsplit("-", 1)[1])
    churn = scenario.startswith("churn")
    uniform = scenario.startswith("uniform")
    specs = []
    for i, placement in enumerate(place_jobs(rng, per_gpu)):
        c = 0.05 if uniform else rng.uniform(0.030, 0.070)
        m = 0.05 if uniform else c * rng.uniform(0.5, 2.0)
        spread = 0.05 if uniform else 0.1
        ranks = tuple(c * rng.uniform(1 - spread, 1 + spread) for _ in placement)
        arrival, n_iters, leave = 0.0, iters, None
        if churn:
            arrival = 0.0 if rng.random() < 0.5 else rng.uniform(0.0, 15.0)
            n_iters = rng.randint(iters // 2, iters * 3 // 2)
            if rng.random() < 0.1:
                leave = arrival + rng.uniform(2.0, 15.0)
        specs.append(JobSpec(f"j{i:03d}", tuple(placement), ranks, m, iterations=n_iters, arrival_s=arrival,
                             leave_s=leave, jitter=0.1))
    return specs


def run_large(scenario: str, policy: str, args: dict[str, Any], run: int = 0) -> dict[str, Any]:
    """One policy on one large scenario. The jobs come from `--seed`; run r draws its own jitter, job ids and
    start-up spread (simulator seed `seed + 1000 r`), so runs of one scenario differ only in the world's luck."""
    jobs = large_jobs(scenario, args["iters"], args["seed"])
    sim_seed = args["seed"] + 1000 * run
    cfg = SimConfig(seed=sim_seed, switch_penalty=args["switch_penalty"], startup_spread_s=args["spread"],
                    grant_latency_s=args["grant_latency_ms"] / 1000, link_sharing=args["link_sharing"],
                    interference=args["interference"])
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(jobs, policy, n_nodes=N_NODES, devices_per_node=GPUS, config=cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    waits = [j.grant_wait_max_s for j in res.jobs]
    rates = [j.iter_per_s for j in res.jobs if j.iter_per_s]
    return {"kind": "large", "scenario": scenario, "policy": policy, "run": run, "sim_seed": sim_seed,
            "wall_s": wall, "cpu_s": cpu, "n_jobs": len(jobs),
            "job_iter_s_min": min(rates, default=None), "job_iter_s_max": max(rates, default=None),
            "n_ranks": sum(len(j.placement) for j in jobs), "grant_wait_max_s": max(waits, default=0.0),
            **res.to_dict(per_job=args["per_job"])}


def hetero_jobs(scenario: str, iters: int, jitter: float) -> tuple[int, list[JobSpec]]:
    """(nodes, jobs) of a heterogeneous scenario: (name, nodes, C ms, M ms) per job, one GPU per node."""
    table = {
        "span-3": (3, [("A", (0, 1), 30, 60), ("B", (1, 2), 60, 30), ("C", (0, 2), 45, 45), ("D", (0, 1, 2), 20, 40)]),
        "span-4": (4, [("A", (0, 1), 30, 60), ("B", (1, 2), 60, 30), ("C", (2, 3), 45, 45), ("D", (3, 0), 20, 50),
                       ("E", (0, 1, 2, 3), 40, 40)]),
    }
    n_nodes, rows = table[scenario.removesuffix("-churn")]
    jobs = [JobSpec(name, tuple((n, 0) for n in nodes), c / 1000, m / 1000, iterations=iters, jitter=jitter)
            for name, nodes, c, m in rows]
    if scenario.endswith("-churn"):
        jobs[1] = dataclasses.replace(jobs[1], leave_s=4.0)
        jobs.append(JobSpec("F", ((1, 0), (3, 0)), 0.025, 0.035, iterations=iters, arrival_s=2.0, jitter=jitter))
    return n_nodes, jobs


def run_hetero(scenario: str, jitter: float, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every policy in HETERO_POLICIES on one heterogeneous scenario, and the offline reference if static."""
    n_nodes, jobs = hetero_jobs(scenario, args["iters"], jitter)
    cfg = SimConfig(seed=args["seed"], switch_penalty=args["switch_penalty"],
                    grant_latency_s=args["grant_latency_ms"] / 1000, link_sharing=args["link_sharing"],
                    interference=args["interference"])
    ref = None
    if not scenario.endswith("-churn"):
        exact_jobs = hetero_jobs(scenario, min(args["iters"], 60), 0.0)[1]
        ref = best_cyclic_orders(exact_jobs, n_nodes=n_nodes, config=cfg)
    rows = []
    runs = [(p, simulate(jobs, p, n_nodes=n_nodes, config=cfg)) for p in HETERO_POLICIES]
    if ref is not None:
        runs.append(("reference", run_orders(jobs, ref.orders, n_nodes=n_nodes, config=cfg)))
    for policy, res in runs:
        rows.append({**res.to_dict(per_job=args["per_job"]), "kind": "hetero", "scenario": scenario,
                     "jitter": jitter, "policy": policy,
                     "grant_wait_max_s": max((j.grant_wait_max_s for j in res.jobs), default=0.0),
                     "reference_orders": {f"{n}/{d}": list(o) for (n, d), o in ref.orders.items()} if ref else None,
                     "reference_searched": ref.searched if ref else None})
    return rows


def run_small(n_jobs: int, ratio: str, policy: str, args: dict[str, Any]) -> dict[str, Any]:
    c = args["compute_ms"] / 1000
    m = args["comm_ms"] / 1000 * SMALL_RATIOS[ratio]
    t0 = time.perf_counter()
    res = simulate_small(c, m, n_jobs, policy, iterations=args["iters"], seed=args["seed"],
                         switch_penalty=args["switch_penalty"], grant_latency_s=args["grant_latency_ms"] / 1000,
                         link_sharing=args["link_sharing"], interference=args["interference"])
    return {"kind": "small", "scenario": f"{n_jobs} jobs {ratio}", "ratio": ratio, **res,
            "wall_s": time.perf_counter() - t0}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def large_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title=f"simulated cluster: {N_NODES} nodes x {GPUS} GPUs (sum of per-job iterations/s)")
    for c in ("scenario", "policy", "jobs", "ranks", "it/s", "x unsched", "norm thr", "bound %", "job it/s min-max",
              "slowdown mean", "max", "fairness", "busy", "idle-wait", "wait max ms", "cpu s"):
        t.add_column(c, justify="right")
    for sc in LARGE:
        block = sorted((r for r in rows if r["scenario"] == sc), key=lambda r: list(POLICIES).index(r["policy"]))
        base = next((r["throughput_iter_s"] for r in block if r["policy"] == "passthrough"), None)
        for r in block:
            t.add_row(sc, r["policy"], str(r["n_jobs"]), str(r["n_ranks"]), f"{r['throughput_iter_s']:.1f}",
                      _f(r["throughput_iter_s"] / base if base else None, ".2f"),
                      f"{r['normalized_throughput']:.1f}", _f(r["bound_fraction"] and 100 * r["bound_fraction"], ".0f"),
                      f"{_f(r['job_iter_s_min'], '.1f')}-{_f(r['job_iter_s_max'], '.1f')}",
                      _f(r["slowdown_mean"], ".2f"), _f(r["slowdown_max"], ".2f"), _f(r["fairness"], ".2f"),
                      f"{r['device_busy']:.2f}", f"{r['idle_waiting']:.2f}", f"{1000 * r['grant_wait_max_s']:.0f}",
                      f"{r['cpu_s']:.1f}", end_section=r is block[-1])
    return t


def runs_table(rows: list[dict[str, Any]], runs: int) -> Table:
    """Each policy over `runs` runs of every large scenario, against exclusive: a cluster of 64 nodes falls into
    different alternations from one run's luck to the next, so one run's ratio is one draw, not the policy's."""
    t = Table(title=f"large scenarios over {runs} runs each (same jobs, the simulator's seed varied): "
                    "sum of per-job iterations/s")
    for c in ("scenario", "policy", "it/s median", "min-max", "x exclusive (medians)", "x exclusive, run by run",
              "runs >= exclusive"):
        t.add_column(c, justify="right")
    by_run = sorted(rows, key=lambda r: r["run"])
    for sc in LARGE:
        by = {p: [r["throughput_iter_s"] for r in by_run if r["scenario"] == sc and r["policy"] == p]
              for p in POLICIES}
        by = {p: v for p, v in by.items() if v}
        excl = by.get("exclusive")
        for p, v in by.items():
            paired = [a / b for a, b in zip(v, excl)] if excl else []
            t.add_row(sc, p, f"{statistics.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}",
                      _f(statistics.median(v) / statistics.median(excl) if excl else None, ".3f"),
                      f"{min(paired):.3f}-{max(paired):.3f}" if paired else "-",
                      f"{sum(x >= 1.0 for x in paired)}/{len(paired)}" if paired else "-",
                      end_section=p == list(by)[-1])
    return t


def pooled_table(files: list[Path]) -> Table:
    """Every policy against exclusive over the runs of several result files (`--runs`, one `--seed` each).

    Run r of every policy shares its simulator seed, so each run's it/s is divided by exclusive's in the same
    run (paired); the table gives the mean of those ratios with two standard errors, and the spread of one
    policy's own runs on the same jobs (its sd, each run against the mean of its file and scenario)."""
    ratios: dict[tuple[str, str], list[float]] = {}
    own: dict[tuple[str, str], list[float]] = {}
    for path in files:
        rows = json.loads(path.read_text())["large"]
        for sc in LARGE:
            by = {(r["policy"], r["run"]): r["throughput_iter_s"] for r in rows if r["scenario"] == sc}
            for (policy, run), thr in by.items():
                if ("exclusive", run) in by:
                    ratios.setdefault((sc, policy), []).append(thr / by[("exclusive", run)])
            for policy in {p for p, _ in by}:
                mine = [t for (p, _), t in by.items() if p == policy]
                own.setdefault((sc, policy), []).extend(t / statistics.mean(mine) for t in mine)
    t = Table(title=f"pooled over {len(files)} result files: each run's it/s / exclusive's in the same run")
    for c in ("scenario", "policy", "runs", "x exclusive", "± 2 SE", "sd of one run"):
        t.add_column(c, justify="right")
    for sc in (*LARGE, "all"):
        scs = LARGE if sc == "all" else (sc,)
        names = [p for p in POLICIES if any((s, p) in ratios for s in scs)]
        for policy in names:
            v = [x for s in scs for x in ratios.get((s, policy), [])]
            mine = [x for s in scs for x in own.get((s, policy), [])]
            se = statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 and policy != "exclusive" else None
            t.add_row(sc, policy, str(len(v)), f"{statistics.mean(v):.3f}", _f(se if se is None else 2 * se, ".3f"),
                      _f(statistics.stdev(mine) if len(mine) > 1 else None, ".3f"), end_section=policy == names[-1])
    return t


def hetero_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="heterogeneous scenarios (3-4 nodes x 1 GPU, jobs with their own C, M and nodes): "
                    "sum of per-job iterations/s")
    for c in ("scenario", "jitter", "policy", "it/s", "x exclusive", "% of reference", "bound %", "norm thr",
              "fairness", "wait max ms"):
        t.add_column(c, justify="right")
    for sc in HETERO:
        for jitter in sorted({r["jitter"] for r in rows}):
            block = {r["policy"]: r for r in rows if r["scenario"] == sc and r["jitter"] == jitter}
            if not block:
                continue
            base = block["exclusive"]["throughput_iter_s"]
            ref = block.get("reference", {}).get("throughput_iter_s")
            names = [p for p in (*HETERO_POLICIES, "reference") if p in block]
            for p in names:
                r = block[p]
                thr = r["throughput_iter_s"]
                t.add_row(sc, f"{jitter:g}", p, f"{thr:.2f}", f"{thr / base:.3f}",
                          _f(ref and 100 * thr / ref, ".1f"),
                          _f(r["bound_fraction"] and 100 * r["bound_fraction"], ".0f"),
                          f"{r['normalized_throughput']:.2f}", _f(r["fairness"], ".2f"),
                          f"{1000 * r['grant_wait_max_s']:.0f}", end_section=p == names[-1])
    return t


def small_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    t = Table(title=f"small scenarios (2 nodes x 1 device; C = {args.compute_ms:g} ms, M = {args.comm_ms:g} ms "
                    "x ratio): aggregate iterations/s")
    for c in ("scenario", "policy", "it/s", "x unsched", "x sequential", "bound %", "slowdown", "fairness", "busy"):
        t.add_column(c, justify="right")
    for n in (2, 3):
        for ratio in SMALL_RATIOS:
            block = {r["policy"]: r for r in rows if r["n_jobs"] == n and r["ratio"] == ratio}
            base = block.get("passthrough", {}).get("throughput_iter_s")
            seq = block.get("sequential", {}).get("throughput_iter_s")
            for p in SMALL_POLICIES:
                r = block.get(p)
                if r is None:
                    continue
                thr = r["throughput_iter_s"]
                t.add_row(f"{n} jobs {ratio}", p, f"{thr:.2f}", _f(thr / base if base else None, ".2f"),
                          _f(thr / seq if seq else None, ".2f"), f"{100 * r['bound_fraction']:.0f}",
                          f"{max(r['slowdown']):.2f}", f"{r['fairness']:.2f}", f"{r['device_busy']:.2f}",
                          end_section=p == SMALL_POLICIES[-1])
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="only the small (emulated-cluster) scenarios")
    p.add_argument("--scenarios", nargs="*", default=list(LARGE), choices=LARGE)
    p.add_argument("--no-hetero", action="store_true", help="skip the heterogeneous scenarios and their reference")
    p.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--iters", type=int, default=200, help="iterations per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1,
                   help="large scenarios: run each policy this many times on the same jobs, each run with its own "
                        "jitter, job ids and start-up (simulator seed SEED + 1000 r), and add a table of medians "
                        "and spreads: with fifo links one run's ratio between policies swings by 10-50 %%")
    p.add_argument("--switch-penalty", type=float, default=0.1,
                   help="slowdown of co-running computes (passthrough): each of k runs at 1/(k(1+p))")
    p.add_argument("--spread", type=float, default=1.0, help="a job's ranks join within this many seconds")
    p.add_argument("--grant-latency-ms", type=float, default=0.3)
    p.add_argument("--link-sharing", choices=LINK_SHARING, default="fair",
                   help="how concurrent allreduces share a link: fair (equal rates; unscheduled jobs stay in "
                        "lockstep) or fifo (in the order they began; unscheduled jobs fall into alternation). "
                        "Real links lie between: run both to bracket the unscheduled baseline")
    p.add_argument("--interference", type=float, default=0.0,
                   help="a compute phase and an allreduce on one device each run at 1/(1+this) while both are "
                        "active (the emulated cluster's Gloo threads share the pinned core; NCCL kernels take SMs)")
    p.add_argument("--compute-ms", type=float, default=50.0, help="small scenarios: C")
    p.add_argument("--comm-ms", type=float, default=50.0, help="small scenarios: M at 1:1 (scaled by the ratio)")
    p.add_argument("--per-job", action="store_true", help="keep per-job results in the JSON")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("results/simulate.json"))
    p.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                   help="simulate nothing: pool the large scenarios' runs of these result files (one --seed each, "
                        "made with --runs) into one comparison with exclusive, and print it")
    args = p.parse_args()
    if args.pool:
        missing = [str(f) for f in args.pool if not f.is_file()]
        if missing:
            p.error(f"--pool: no such file: {', '.join(missing)}")
        Console(width=None if sys.stdout.isatty() else 160).print(pooled_table(args.pool))
        return
    if args.runs < 1:
        p.error(f"--runs {args.runs}: at least 1")
    common = {"iters": args.iters, "seed": args.seed, "switch_penalty": args.switch_penalty, "spread": args.spread,
              "grant_latency_ms": args.grant_latency_ms, "compute_ms": args.compute_ms, "comm_ms": args.comm_ms,
              "per_job": args.per_job, "link_sharing": args.link_sharing, "interference": args.interference}

    cases: list[tuple[Any, ...]] = []
    if not args.small:
        # Larger scenarios first, so the pool's last jobs are short ones.
        for sc in sorted(args.scenarios, key=lambda s: -int(s[-1])):
            cases += [(run_large, sc, pol, common, run) for run in range(args.runs) for pol in args.policies]
        if not args.no_hetero:
            cases += [(run_hetero, sc, jitter, common) for sc in HETERO for jitter in (0.0, 0.1)]
    cases += [(run_small, n, ratio, pol, common) for n in (2, 3) for ratio in SMALL_RATIOS for pol in SMALL_POLICIES]

    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True) as progress, \
            ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        task = progress.add_task("simulating", total=len(cases))
        futures = {pool.submit(fn, *rest): rest for fn, *rest in cases}
        for fut in as_completed(futures):
            out = fut.result()
            rs = out if isinstance(out, list) else [out]
            results += rs
            progress.update(task, advance=1, description=f"done: {rs[0]['scenario']} / {rs[-1]['policy']}")
    elapsed = time.perf_counter() - t0

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a file or a pipe: keep the table's rows on one line
    large = [r for r in results if r["kind"] == "large"]
    small = [r for r in results if r["kind"] == "small"]
    hetero = [r for r in results if r["kind"] == "hetero"]
    if large:
        console.print(large_table([r for r in large if r["run"] == 0]))
        if args.runs > 1:
            console.print(runs_table(large, args.runs))
    if hetero:
        console.print(hetero_table(hetero))
    console.print(small_table(small, args))
    write_json(args.out, {"benchmark": "simulate", "version": 1, "time": time.time(), "machine": machine(),
                          "args": {**vars(args), "out": str(args.out)}, "elapsed_s": elapsed,
                          "large": sorted(large, key=lambda r: (r["scenario"], r["policy"], r["run"])),
                          "hetero": sorted(hetero, key=lambda r: (r["scenario"], r["jitter"], r["policy"])),
                          "small": sorted(small, key=lambda r: (r["scenario"], r["policy"]))})
    cpu = sum(r["wall_s"] if r["kind"] == "small" else r.get("cpu_s", 0.0) for r in results)
    print(f"wrote {args.out}: {len(results)} runs in {elapsed:.1f} s ({cpu:.1f} s of CPU in the runs, "
          f"{args.workers} workers)")


if __name__ == "__main__":
    main()
