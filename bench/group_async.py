"""Group-level async training against sync, LB-BSP and fully asynchronous training, on real data.

One `horovodrun --gloo` job per workload and repeat (4 ranks, or --ranks)
trains every run in sequence (testbed/workloads/train_classifier.py, paced like
bench/convergence/ so each rank behaves like its own device). The fault is
on the last rank, or the last few. Scenarios:

* ``no_straggler``: sync, the reference time to target.
* ``straggler``: the last rank delayed by 300 % (4x its compute time, a
  proportional sleep). Methods: ``sync``, ``lbbsp`` (weighted), ``ga-static``
  (G = 2 consecutive halves, each group's batch cut by its members' paces),
  ``ga-static-tcp`` (the same without shared memory, as groups that span nodes: exchanges over TCP and
  the model broadcast to each group), ``ga-equal`` (the same with equal shares: CROSSOVER_GROUP_BALANCE=0),
  ``ga-speed`` (G = 2 from measured paces), ``ga-speed-equal`` (the same with
  equal shares, SDPipe's setting), ``staged`` (static G = 2,
  CROSSOVER_GROUP_SCHEDULE=staged), ``async`` (G = ranks: every rank its
  own group) and ``staged-async`` (the staged schedule on one group per rank).
* ``stall``: the last rank stalls 2 s after a step with probability 5 %.
* ``drift``: paces that change, as on a shared node whose other jobs come and go: the third rank from the
  end is 3x slower from 20 s to 60 s of training, then itself again, and the last rank 3x slower from
  70 s to 120 s (``DRIFT``). Its bound is the average one: the sync run's speeds over the whole run.
* ``mixed``: the last three ranks at 1.5x, 2x and 4x, the others at 1x (``MIXED``).

``drift`` and ``mixed`` run every method. Beside the table per run, a table of the issue's targets per
scenario (`targets`): speed groups against static ones, the staged schedule against the best fixed
setting (G = 2 and G = ranks alike), and what each global boundary of speed grouping cost.

Workloads: ``digits`` (a small CNN), ``mnist1d`` (a 1-D CNN) and ``mnist1d-5m``
(a 5.04 M-parameter MLP on MNIST-1D, generated offline). Reported per run:
time to a fixed accuracy and to the issue's target (the no-straggler sync
run's final accuracy less 0.5 points), each over the no-straggler sync run's
time, beside the capacity bound (``world / sum(speed)``, see `bounds`); the
final accuracy (for group_async, of the one model the groups mix into at the
end) against sync's; and the staleness histogram the parameter service
measured (never above the bound). What one exchange costs is `bench.exchange_cost`.

    python -m bench.group_async [--quick] [--datasets digits,mnist1d] [--out results/group_async]
    python -m bench.group_async --datasets mnist1d-5m --ranks 8 --repeats 2 --methods ga-static,async
    python -m bench.group_async --datasets mnist1d --ranks 8 --scenarios drift,mixed --pace 16

Writes `<out>.json` (after every job), `<out>_<workload>.png` (the first repeat's curves and staleness
histograms) and prints a table per workload: medians over repeats with their range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from bench.convergence.judge import first_reaching
from bench.convergence.run import choose_pace
from bench.lib.jobs import finish_job, start_job
from bench.lib.plot import pyplot, save
from testbed.harness.jobs import WORKLOADS, rank_summaries

WORKLOAD = WORKLOADS / "train_classifier.py"
SLOWDOWN = 4.0  # the straggler: delayed by 300 %
STALL = (2.0, 0.05)  # the stalling rank: 2 s after a step, with probability 5 %
# Paces that change, as on a shared node whose other jobs come and go (seconds of each run's training):
# one rank slows 3x for a while and recovers, another slows later.
DRIFT = ((3.0, 20.0, 60.0), (3.0, 70.0, 120.0))
MIXED = (1.5, 2.0, 4.0)  # the last ranks' slowdowns in the mixed scenario; the others run at 1x
BOUND = 4
# A workload: its data, model and training; "target"/"quick_target" are fixed accuracies, reported beside the
# target the issue sets (the no-straggler sync run's final accuracy less RELATIVE_PP points).
PAIRS: dict[str, dict[str, Any]] = {
    "digits": {"dataset": "digits", "model": "cnn", "width": 512, "global_batch": 128, "lr": 0.05, "target": 0.95,
               "quick_target": 0.85, "epochs": 8},
    "mnist1d": {"dataset": "mnist1d", "model": "cnn", "width": 1024, "global_batch": 256, "lr": 0.1,
                "target": 0.75, "quick_target": 0.65, "epochs": 12},
    # 5.04 M parameters (40 -> 2220 -> 2220 -> 10): a model whose exchange is not free
    "mnist1d-5m": {"dataset": "mnist1d", "model": "mlp", "width": 2220, "global_batch": 256, "lr": 0.05,
                   "target": 0.55, "quick_target": 0.50, "epochs": 20},
}
RELATIVE_PP = 0.5  # the target: the sync run's final accuracy less this many points
WITHIN_BOUND = 1.10  # ... reached within this factor of the capacity bound
FINAL_PP = 1.5  # ... and a final accuracy within this many points of sync's
GA = {"CROSSOVER_STALENESS": str(BOUND), "CROSSOVER_EXCHANGE_PERIOD": "0.5"}


def methods(world: int) -> dict[str, tuple[str, dict[str, str]]]:
    """Each method's aggregation rule and settings, for ``world`` ranks."""
    return {
        "sync": ("average", {}),
        "lbbsp": ("weighted", {"CROSSOVER_LBBSP_WARMUP": "2"}),
        "ga-static": ("group_async", {**GA, "CROSSOVER_GROUPS": "2"}),
        "ga-static-tcp": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_EXCHANGE_SHM": "0"}),
        "ga-equal": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUP_BALANCE": "0"}),
        "ga-speed": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUPING": "speed"}),
        "ga-speed-equal": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUPING": "speed",
                                           "CROSSOVER_GROUP_BALANCE": "0"}),
        "staged": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUP_SCHEDULE": "staged"}),
        "async": ("group_async", {**GA, "CROSSOVER_GROUPS": str(world)}),
        "staged-async": ("group_async", {**GA, "CROSSOVER_GROUPS": str(world), "CROSSOVER_GROUP_SCHEDULE": "staged"}),
    }


# the fixed settings a staged schedule must beat, and the staged ones
FIXED = ("ga-static", "ga-equal", "ga-speed", "ga-speed-equal", "async")
STAGED = ("staged", "staged-async")


def scenarios(world: int) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each scenario's fault (on the last rank; drift and mixed: on the last few) and the methods it runs."""
    last = world - 1
    every = ["sync", "lbbsp", "ga-static", "ga-equal", "ga-speed", "ga-speed-equal", "staged", "async", "staged-async"]
    (f1, a1, b1), (f2, a2, b2) = DRIFT
    drift = f"{max(0, world - 3)}:{f1:g}@{a1:g}-{b1:g},{last}:{f2:g}@{a2:g}-{b2:g}"
    mixed = ",".join(f"{world - len(MIXED) + i}:{f:g}" for i, f in enumerate(MIXED))
    return {
        "no_straggler": ({}, ["sync"]),
        "straggler": ({"straggler": f"{last}:{SLOWDOWN}", "straggler_work": "sleep"},
                      ["sync", "lbbsp", "ga-static", "ga-static-tcp", "ga-equal", "ga-speed", "staged", "async",
                       "staged-async"]),
        "stall": ({"stall": f"{last}:{STALL[0]}:{STALL[1]}"}, ["sync", "ga-static", "ga-equal", "ga-speed",
                                                              "ga-speed-equal", "lbbsp", "async"]),
        "drift": ({"drift": drift, "straggler_work": "sleep"}, every),
        "mixed": ({"straggler": mixed, "straggler_work": "sleep"}, every),
    }


def plan(dataset: str, quick: bool, world: int = 4, only: Optional[set[str]] = None,
         where: Optional[set[str]] = None, epochs: int = 0) -> list[dict[str, Any]]:
    """The runs of one job: a warm-up, then every scenario's methods (``only``: these methods; ``where``: these
    scenarios; the no-straggler sync run, every ratio's reference, always runs)."""
    pair = PAIRS[dataset]
    epochs = epochs or (max(2, pair["epochs"] // 2) if quick else pair["epochs"])
    common = {"model": pair["model"], "width": pair["width"], "global_batch": pair["global_batch"], "lr": pair["lr"],
              "epochs": epochs, "evals_per_epoch": 4, "period": 5}
    runs = [{**common, "name": "warmup", "rule": "average", "epochs": 1}]
    table = methods(world)
    for scenario, (faults, names) in scenarios(world).items():
        if where is not None and scenario not in where and scenario != "no_straggler":
            continue
        for method in names:
            if (only is not None and method not in only and f"{scenario}/{method}" not in only
                    and scenario != "no_straggler"):
                continue
            rule, env = table[method]
            runs.append({**common, **faults, "name": f"{scenario}/{method}", "rule": rule, "env": env})
    return runs


def summarise(run: dict[str, Any], target: float, relative: Optional[float]) -> dict[str, Any]:
    """One run's figures: times to the fixed and to the relative target (``None``: no reference run)."""
    hit = first_reaching(run["curve"], target)
    hit_relative = None if relative is None else first_reaching(run["curve"], relative)
    stats = run.get("group_async") or {}
    service = stats.get("service") or {}
    return {
        "time_to_target_s": hit[2] if hit else None,
        "time_to_relative_s": hit_relative[2] if hit_relative else None,
        "final_acc": run["final_acc"], "train_s": run["train_s"],
        "steps": run["steps"], "aggregation": run["aggregation"], "curve": run["curve"],
        "staleness": {int(k): v for k, v in (service.get("gaps") or {}).items()},
        "exchanges": service.get("exchanges"), "bound": BOUND if stats else None,
        "exchange_s_p50": stats.get("exchange_s_p50"), "groups": stats.get("history"),
        "boundaries": [h["cost"] for h in stats.get("history") or [] if "cost" in h and h["epoch"] > 0],
        "switches": service.get("switches"), "step_costs_s": stats.get("step_costs_s"),
    }


def run_dataset(dataset: str, args: argparse.Namespace, console: Console, workdir: Path,
                repeat: int = 0) -> dict[str, Any]:
    """One job: every run of the plan in sequence, on ``args.ranks`` ranks."""
    world = args.ranks
    only = set(args.methods.split(",")) if args.methods else None
    where = set(args.scenarios.split(",")) if args.scenarios else None
    runs = plan(dataset, args.quick, world, only, where, args.epochs)
    specs = workdir / f"{dataset}.{repeat}.runs.json"
    specs.write_text(json.dumps(runs))
    pace = choose_pace(argparse.Namespace(pace=args.pace, np=world))
    pair = PAIRS[dataset]
    console.print(f"{dataset} (repeat {repeat + 1}/{args.repeats}): {len(runs)} runs in one {world}-rank job, "
                  f"pace {pace}")
    started = time.monotonic()
    proc, out = start_job(f"ga-{dataset}-{repeat}", WORKLOAD, workdir, world,
                          ["--dataset", pair["dataset"], "--data", str(workdir / "mnist1d.npz"),
                           "--model", pair["model"], "--width", str(pair["width"]), "--runs", f"@{specs}",
                           "--pace", str(pace)],
                          {"PYTHONUNBUFFERED": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    log = workdir / f"ga-{dataset}-{repeat}.log"
    done = 0
    while proc.poll() is None:
        text = log.read_text(errors="replace") if log.exists() else ""
        finished = text.count("]<stdout>:run ")
        if finished != done:
            done = finished
            console.print(f"  {dataset}: {done}/{len(runs)} runs done, {time.monotonic() - started:.0f} s "
                          f"({runs[min(done, len(runs) - 1)]['name']} next)")
        time.sleep(1.0)
    failure = None
    try:
        ranks = finish_job(proc, out, timeout=10)
    except RuntimeError as exc:  # keep the runs that finished, and say which one failed and how
        ranks = rank_summaries(out)
        failure = {"error": str(exc), "log_tail": log.read_text(errors="replace")[-4000:]}
        console.print(f"[red]{dataset}: the job failed after {done} runs[/red]\n{failure['log_tail'][-1500:]}")
    target = pair["quick_target"] if args.quick else pair["target"]
    by_name = {r["name"]: r for r in ranks[0]["runs"] if r["name"] != "warmup"}
    reference = by_name.get("no_straggler/sync")
    relative = None if reference is None else reference["final_acc"] - RELATIVE_PP / 100
    results = {name: summarise(r, target, relative) for name, r in by_name.items()}
    for name, r in results.items():
        r["shares"] = [(run.get("group_async") or {}).get("shares") for rank in ranks for run in rank["runs"]
                       if run["name"] == name]  # each rank's samples per step as its run ended
    return {"pace": pace, "ranks": world, "target": target, "relative_target": relative, "epochs": runs[1]["epochs"],
            "runs": results, "failure": failure, "bounds": bounds(ranks, world), "wall_s": time.monotonic() - started}


def bounds(ranks: list[dict[str, Any]], world: int = 4) -> dict[str, float]:
    """Per scenario, the least time to target relative to the no-straggler run that any method can reach
    without learning more per sample than sync does: ``world / sum(speed)``, where a rank's speed is its
    compute time over compute plus the time its fault added (measured in the scenario's sync run)."""
    out = {}
    for scenario in scenarios(world):
        names = [r["name"] for r in ranks[0]["runs"] if r["name"].startswith(f"{scenario}/")]
        if not names:
            continue
        # the sync run's step structure; without one (--methods), the first run's: a straggler's
        # slowdown is per unit of compute, so its speed is the same in every run
        name = f"{scenario}/sync" if f"{scenario}/sync" in names else names[0]
        runs = [next((r for r in rank["runs"] if r["name"] == name), None) for rank in ranks]
        if all(r is not None for r in runs):
            speeds = [r["compute_s"] / (r["compute_s"] + r["straggler_extra_s"]) for r in runs if r]
            out[scenario] = len(speeds) / sum(speeds)
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def judged(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per run of one job: its time to the relative target over the no-straggler sync run's, that over the
    scenario's capacity bound, its final accuracy against sync's, and whether it meets the issue's target
    (within WITHIN_BOUND of the bound, final accuracy within FINAL_PP points)."""
    runs = data["runs"]
    reference = runs.get("no_straggler/sync", {})
    out = {}
    for name, r in runs.items():
        scenario = name.split("/")[0]
        ratio = _ratio(r.get("time_to_relative_s"), reference.get("time_to_relative_s"))
        bound = data["bounds"].get(scenario)
        over = None if ratio is None or bound is None else ratio / bound
        pp = None if not reference else 100 * (r["final_acc"] - reference["final_acc"])
        out[name] = {"ratio": ratio, "bound": bound, "over_bound": over, "final_pp": pp,
                     "meets": over is not None and over <= WITHIN_BOUND and pp is not None and pp >= -FINAL_PP}
    return out


def targets(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per scenario, issue 57's ratios of times to the relative target: speed groups over static ones (<= 0.9
    where paces change, <= 1.05 with a fixed straggler), and the best staged run over the best fixed setting
    (<= 0.85, never above 1.05); and what speed grouping's later global boundaries cost, each (median)."""
    out: dict[str, dict[str, Any]] = {}
    runs = data["runs"]
    for scenario in {name.split("/")[0] for name in runs} - {"no_straggler"}:
        def t(method: str, scenario: str = scenario) -> Optional[float]:
            return runs.get(f"{scenario}/{method}", {}).get("time_to_relative_s")

        fixed: dict[str, float] = {m: v for m in FIXED if (v := t(m)) is not None}
        staged: dict[str, float] = {m: v for m in STAGED if (v := t(m)) is not None}
        best_fixed = min(fixed, key=fixed.__getitem__) if fixed else None
        best_staged = min(staged, key=staged.__getitem__) if staged else None
        costs = runs.get(f"{scenario}/ga-speed", {}).get("boundaries") or []
        out[scenario] = {
            "speed_over_static": _ratio(t("ga-speed"), t("ga-static")),
            "speed_equal_over_equal": _ratio(t("ga-speed-equal"), t("ga-equal")),
            "best_fixed": best_fixed, "best_staged": best_staged,
            "staged_over_best_fixed": _ratio(staged.get(best_staged or ""), fixed.get(best_fixed or "")),
            "staged_over_static": _ratio(t("staged"), t("ga-static")),
            "staged_async_over_async": _ratio(t("staged-async"), t("async")),
            "speed_boundaries": len(costs),
            "boundary_s_p50": statistics.median(sum(c.values()) for c in costs) if costs else None,
            "boundary_wait_s_p50": statistics.median(c["wait_s"] for c in costs) if costs else None,
        }
    return out


def targets_table(dataset: str, repeats: list[dict[str, Any]]) -> Table:
    t = Table(title=f"{dataset}: issue 57's targets (medians over repeats; time to the relative target)")
    for col in ("scenario", "speed / static", "speed / static, equal shares", "best staged / best fixed",
                "staged / ga-static", "staged-async / async", "speed's boundaries", "each (s)", "of which waiting (s)"):
        t.add_column(col)
    scenarios_seen = sorted({s for d in repeats for s in d.get("targets", {})})
    for scenario in scenarios_seen:
        rows = [d["targets"][scenario] for d in repeats if scenario in d.get("targets", {})]
        best = f"{rows[0]['best_staged']} / {rows[0]['best_fixed']}: " if rows[0]["best_fixed"] else ""
        t.add_row(scenario, _spread([r["speed_over_static"] for r in rows]),
                  _spread([r["speed_equal_over_equal"] for r in rows]),
                  best + _spread([r["staged_over_best_fixed"] for r in rows]),
                  _spread([r["staged_over_static"] for r in rows]),
                  _spread([r["staged_async_over_async"] for r in rows]),
                  _spread([float(r["speed_boundaries"]) for r in rows], 0, ""),
                  _spread([r["boundary_s_p50"] for r in rows], 3, ""),
                  _spread([r["boundary_wait_s_p50"] for r in rows], 3, ""))
    return t


def _spread(values: list[Optional[float]], digits: int = 2, suffix: str = "x") -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "-"
    missing = len(values) - len(got)
    text = f"{statistics.median(got):.{digits}f}{suffix}"
    if len(got) > 1:
        text += f" ({got[0]:.{digits}f} to {got[-1]:.{digits}f})"
    return text + (f" +{missing} never" if missing else "")


def table(dataset: str, repeats: list[dict[str, Any]]) -> Table:
    """Medians over repeats, with the range: time to the fixed and to the relative target, each against
    the no-straggler sync run of the same job, the bound, the final accuracy against sync's."""
    first = repeats[0]
    verdicts = [data["judged"] for data in repeats]
    relative = ", ".join(f"{d['relative_target']:.3f}" for d in repeats if d["relative_target"] is not None)
    t = Table(title=f"{dataset}: {first['ranks']} ranks, {first['epochs']} epochs, {len(repeats)} repeat(s); "
                    f"fixed target {first['target']}, relative target {relative}")
    for col in ("run", "to fixed target, x sync", "to relative target, x sync", "bound", "x bound",
                "final acc", "vs sync (pp)", "meets", "staleness max/bound"):
        t.add_column(col)
    for name in first["runs"]:
        fixed = [_ratio(d["runs"].get(name, {}).get("time_to_target_s"),
                        d["runs"].get("no_straggler/sync", {}).get("time_to_target_s")) for d in repeats]
        marks = [v.get(name, {}) for v in verdicts]
        stale = [max(d["runs"][name]["staleness"]) for d in repeats if d["runs"].get(name, {}).get("staleness")]
        bound = [m.get("bound") for m in marks]
        t.add_row(name, _spread(fixed), _spread([m.get("ratio") for m in marks]), _spread(bound),
                  _spread([m.get("over_bound") for m in marks]),
                  _spread([d["runs"].get(name, {}).get("final_acc") for d in repeats], 3, ""),
                  _spread([m.get("final_pp") for m in marks], 1, ""),
                  f"{sum(bool(m.get('meets')) for m in marks)}/{len(marks)}" if name.split("/")[0] != "no_straggler"
                  else "-", f"{max(stale)}/{BOUND}" if stale else "-")
    return t


def plot(dataset: str, data: dict[str, Any], stem: Path) -> str:
    plt = pyplot()
    runs = data["runs"]
    grouped = [(n, r) for n, r in runs.items() if r["staleness"]]
    fig, axes = plt.subplots(1, 2 + (1 if grouped else 0), figsize=(16 if grouped else 11, 4))
    shown = [s for s in ("straggler", "stall", "drift", "mixed") if any(n.startswith(s + "/") for n in runs)][:2]
    for axis, scenario in zip(axes, shown or ["straggler", "stall"]):
        for name, r in runs.items():
            if name.startswith(scenario + "/") or name == "no_straggler/sync":
                axis.plot([p[2] for p in r["curve"]], [p[3] for p in r["curve"]], marker=".",
                          linestyle="--" if name.startswith("no_") else "-", label=name)
        axis.axhline(data["target"], color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlabel("training wall time (s)")
        axis.set_ylabel("test accuracy")
        axis.set_title(scenario)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    if grouped:
        axis = axes[-1]
        width = 0.8 / len(grouped)
        for i, (name, r) in enumerate(grouped):
            gaps = sorted(r["staleness"])
            total = sum(r["staleness"].values())
            axis.bar([g + i * width for g in gaps], [r["staleness"][g] / total for g in gaps], width=width,
                     label=name)
        axis.axvline(BOUND + 0.9, color="red", linewidth=0.8, linestyle=":", label=f"bound {BOUND}")
        axis.set_xlabel("staleness: exchange periods ahead of the slowest group")
        axis.set_ylabel("share of exchanges")
        axis.set_title("staleness histogram (parameter service)")
        axis.legend(fontsize=7)
    fig.tight_layout()
    path = stem.parent / f"{stem.name}_{dataset}.png"
    save(fig, path)
    return str(path)


SERVICE_PORT = 29517  # where the parameter service listens behind a shaped link (CROSSOVER_PARAM_PORT)


def behind_a_link(rate_mbit: float, argv: list[str]) -> int:
    """Run this benchmark again inside a network namespace of its own whose loopback carries the parameter
    service's port at ``rate_mbit`` each way, every other packet unshaped: every leader's exchange crosses a thin
    link (TCP, as from another node), while each group's collectives stay local. Shared memory is off
    (``CROSSOVER_EXCHANGE_SHM=0``), so each group's hand-over is a broadcast too, as for a group spanning
    nodes. The namespace and every process in it go at the end."""
    from testbed.cluster.netns import ip, kill_ns_processes
    from testbed.cluster.shaping import shape_port

    ns = f"xo-ga-link-{os.getpid()}"
    rest, skip = [], False
    for a in argv:  # the same arguments, less the link's
        if skip or a.startswith("--service-link-mbit"):
            skip = a == "--service-link-mbit"
            continue
        rest.append(a)
    ip("netns", "add", ns)
    try:
        shape_port(ns, SERVICE_PORT, rate_mbit)
        env = {**os.environ, "CROSSOVER_PARAM_PORT": str(SERVICE_PORT), "CROSSOVER_EXCHANGE_SHM": "0"}
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "bench.group_async", *rest,
                               "--inside-link", repr(rate_mbit)], env=env, check=False).returncode
    finally:
        kill_ns_processes(ns, grace_s=5.0)
        ip("netns", "del", ns, check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="half the epochs (about 10 minutes per dataset)")
    p.add_argument("--datasets", default="digits", help=f"comma-separated workloads: {', '.join(PAIRS)}")
    p.add_argument("--ranks", type=int, default=4, help="ranks per job (the fault is on the last one)")
    p.add_argument("--repeats", type=int, default=1, help="jobs per workload; tables show the median and range")
    p.add_argument("--methods", default="", help="comma-separated methods (ga-static) or scenario/method "
                   "pairs (stall/sync) to run; the no-straggler sync run always runs; "
                   f"default all: {', '.join(methods(4))}")
    p.add_argument("--scenarios", default="", help="comma-separated scenarios to run (default all: "
                   f"{', '.join(scenarios(4))}); the no-straggler sync run always runs")
    p.add_argument("--epochs", type=int, default=0, help="epochs per run (default the workload's; halved by "
                   "--quick): long enough that the drift scenario's slow spells end and a staged schedule finishes "
                   "its stages")
    p.add_argument("--pace", default="auto", help="device emulation factor, or auto (from the load average)")
    p.add_argument("--out", default="", help="output stem (default results/group_async[_quick])")
    p.add_argument("--service-link-mbit", type=float, default=0.0,
                   help="put the parameter service behind a link of this many Mbit/s each way (its port's traffic on "
                        "the loopback of a network namespace of its own, shaped with tc; needs root): exchanges over "
                        "TCP, everything else local. 0: no link")
    p.add_argument("--inside-link", type=float, default=0.0, help=argparse.SUPPRESS)  # the run behind that link
    args = p.parse_args()
    if args.service_link_mbit > 0 and not args.inside_link:
        raise SystemExit(behind_a_link(args.service_link_mbit, sys.argv[1:]))
    console = Console()
    out = Path(args.out or ("results/group_async" + ("_quick" if args.quick else "")))
    out.parent.mkdir(parents=True, exist_ok=True)
    unknown = [d for d in args.datasets.split(",") if d not in PAIRS]
    if unknown or args.ranks < 2 or args.repeats < 1:
        p.error(f"workloads must be among {', '.join(PAIRS)}; --ranks >= 2; --repeats >= 1")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "ranks": args.ranks, "datasets": {},
                               "service_link_mbit": args.inside_link or None}
    with tempfile.TemporaryDirectory(prefix="crossover-ga-bench-") as tmp:
        for dataset in args.datasets.split(","):
            repeats = []
            for repeat in range(args.repeats):
                repeats.append(run_dataset(dataset, args, console, Path(tmp), repeat))
                repeats[-1]["judged"] = judged(repeats[-1])
                repeats[-1]["targets"] = targets(repeats[-1])
                results["datasets"][dataset] = {"repeats": repeats}
                Path(f"{out}.json").write_text(json.dumps(results, indent=1))  # after every job
            results["datasets"][dataset]["plot"] = plot(dataset, repeats[0], out)
            console.print(table(dataset, repeats))
            console.print(targets_table(dataset, repeats))
            console.print(f"plot: {results['datasets'][dataset]['plot']}")
    Path(f"{out}.json").write_text(json.dumps(results, indent=1))
    console.print(f"wrote {out}.json")


if __name__ == "__main__":
    main()
