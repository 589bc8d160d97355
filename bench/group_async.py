"""Group-level async training against sync, LB-BSP and fully asynchronous training, on real data.

One 4-rank `horovodrun --gloo` job per dataset trains every run in sequence
(tools/workloads/train_classifier.py, paced like bench/convergence.py so each
rank behaves like its own device). Scenarios:

* ``no_straggler``: sync, the reference time to target.
* ``straggler``: rank 3 delayed by 300 % (4x its compute time, a proportional
  sleep). Methods: ``sync``, ``lbbsp`` (weighted), ``ga-static`` (G = 2,
  groups {0,1} and {2,3}), ``ga-speed`` (G = 2 from measured paces),
  ``staged`` (static G = 2, CROSSOVER_GROUP_SCHEDULE=staged) and ``async``
  (G = 4: every rank its own group).
* ``stall``: rank 3 stalls 2 s after a step with probability 5 %.
  Methods: ``sync``, ``lbbsp``, ``ga-static``, ``ga-speed``.

Reported per run: time to the target test accuracy (rank 0's model, training
time without evaluation), final accuracy (for group_async, of the one model
the groups mix into at the end), and the staleness histogram the parameter
service measured (how many exchanges the pushing group was ahead of the
slowest when its answer left; never above the bound). ``--exchange-cost``
times one exchange with a real service process (as rank 0 starts it) over
loopback TCP with each codec and through shared memory, against model size.

    python -m bench.group_async [--quick] [--datasets digits,mnist1d] [--out results/group_async]
    python -m bench.group_async --exchange-cost

Writes `<out>.json`, `<out>_<dataset>.png` (curves and staleness histograms) and prints tables.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from bench.convergence_judge import first_reaching
from bench.convergence_run import choose_pace
from bench.lib.jobs import finish_job, start_job
from bench.lib.plot import pyplot, save
from tools.harness.jobs import WORKLOADS, rank_summaries

WORKLOAD = WORKLOADS / "train_classifier.py"
STRAGGLER = "3:4.0"  # delayed by 300 %
STALL = "3:2.0:0.05"
BOUND = 4
PAIRS: dict[str, dict[str, Any]] = {
    "digits": {"model": "cnn", "width": 512, "global_batch": 128, "lr": 0.05, "target": 0.95, "quick_target": 0.85,
               "epochs": 8},
    "mnist1d": {"model": "cnn", "width": 1024, "global_batch": 256, "lr": 0.1, "target": 0.75, "quick_target": 0.65,
                "epochs": 12},
}
GA = {"CROSSOVER_STALENESS": str(BOUND), "CROSSOVER_EXCHANGE_PERIOD": "0.5"}
METHODS: dict[str, tuple[str, dict[str, str]]] = {
    "sync": ("average", {}),
    "lbbsp": ("weighted", {"CROSSOVER_LBBSP_WARMUP": "2"}),
    "ga-static": ("group_async", {**GA, "CROSSOVER_GROUPS": "2"}),
    "ga-speed": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUPING": "speed"}),
    "staged": ("group_async", {**GA, "CROSSOVER_GROUPS": "2", "CROSSOVER_GROUP_SCHEDULE": "staged"}),
    "async": ("group_async", {**GA, "CROSSOVER_GROUPS": "4"}),
}
SCENARIOS = {
    "no_straggler": ({}, ["sync"]),
    "straggler": ({"straggler": STRAGGLER, "straggler_work": "sleep"},
                  ["sync", "lbbsp", "ga-static", "ga-speed", "staged", "async"]),
    "stall": ({"stall": STALL}, ["sync", "ga-static", "ga-speed", "lbbsp"]),
}


def plan(dataset: str, quick: bool) -> list[dict[str, Any]]:
    pair = PAIRS[dataset]
    epochs = max(2, pair["epochs"] // 2) if quick else pair["epochs"]
    common = {"model": pair["model"], "width": pair["width"], "global_batch": pair["global_batch"], "lr": pair["lr"],
              "epochs": epochs, "evals_per_epoch": 4, "period": 5}
    runs = [{**common, "name": "warmup", "rule": "average", "epochs": 1}]
    for scenario, (faults, methods) in SCENARIOS.items():
        for method in methods:
            rule, env = METHODS[method]
            runs.append({**common, **faults, "name": f"{scenario}/{method}", "rule": rule, "env": env})
    return runs


def summarise(run: dict[str, Any], target: float) -> dict[str, Any]:
    hit = first_reaching(run["curve"], target)
    stats = run.get("group_async") or {}
    service = stats.get("service") or {}
    return {
        "time_to_target_s": hit[2] if hit else None, "final_acc": run["final_acc"], "train_s": run["train_s"],
        "steps": run["steps"], "aggregation": run["aggregation"], "curve": run["curve"],
        "staleness": {int(k): v for k, v in (service.get("gaps") or {}).items()},
        "exchanges": service.get("exchanges"), "bound": BOUND if stats else None,
        "exchange_s_p50": stats.get("exchange_s_p50"), "groups": stats.get("history"),
    }


def run_dataset(dataset: str, args: argparse.Namespace, console: Console, workdir: Path) -> dict[str, Any]:
    runs = plan(dataset, args.quick)
    specs = workdir / f"{dataset}.runs.json"
    specs.write_text(json.dumps(runs))
    pace = choose_pace(argparse.Namespace(pace=args.pace, np=4))
    pair = PAIRS[dataset]
    console.print(f"{dataset}: {len(runs)} runs in one 4-rank job, pace {pace}")
    proc, out = start_job(f"ga-{dataset}", WORKLOAD, workdir, 4,
                          ["--dataset", dataset, "--data", str(workdir / "mnist1d.npz"), "--model", pair["model"],
                           "--width", str(pair["width"]), "--runs", f"@{specs}", "--pace", str(pace)],
                          {"PYTHONUNBUFFERED": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    log = workdir / f"ga-{dataset}.log"
    done = 0
    while proc.poll() is None:
        text = log.read_text(errors="replace") if log.exists() else ""
        finished = text.count("]<stdout>:run ")
        if finished != done:
            done = finished
            console.print(f"  {dataset}: {done}/{len(runs)} runs done ({runs[min(done, len(runs) - 1)]['name']} next)")
        time.sleep(1.0)
    failure = None
    try:
        ranks = finish_job(proc, out, timeout=10)
    except RuntimeError as exc:  # keep the runs that finished, and say which one failed and how
        ranks = rank_summaries(out)
        failure = {"error": str(exc), "log_tail": log.read_text(errors="replace")[-4000:]}
        console.print(f"[red]{dataset}: the job failed after {done} runs[/red]\n{failure['log_tail'][-1500:]}")
    target = pair["quick_target"] if args.quick else pair["target"]
    results = {r["name"]: summarise(r, target) for r in ranks[0]["runs"] if r["name"] != "warmup"}
    return {"pace": pace, "target": target, "epochs": runs[1]["epochs"], "runs": results, "failure": failure,
            "bounds": bounds(ranks)}


def bounds(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Per scenario, the least time to target relative to the no-straggler run that any method can reach
    without learning more per sample than sync does: ``world / sum(speed)``, where a rank's speed is its
    compute time over compute plus the time its fault added (measured in the scenario's sync run)."""
    out = {}
    for scenario in SCENARIOS:
        runs = [next((r for r in rank["runs"] if r["name"] == f"{scenario}/sync"), None) for rank in ranks]
        if all(r is not None for r in runs):
            speeds = [r["compute_s"] / (r["compute_s"] + r["straggler_extra_s"]) for r in runs if r]
            out[scenario] = len(speeds) / sum(speeds)
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def table(dataset: str, data: dict[str, Any]) -> Table:
    runs = data["runs"]
    reference = runs["no_straggler/sync"]["time_to_target_s"]
    sync_acc = {s: runs.get(f"{s}/sync", {}).get("final_acc") for s in SCENARIOS}
    t = Table(title=f"{dataset}: target {data['target']}, {data['epochs']} epochs, pace {data['pace']}")
    for col in ("run", "to target (s)", "vs no-straggler sync", "bound", "final acc", "vs sync (pp)",
                "staleness max/bound", "exchanges"):
        t.add_column(col)
    for name, r in runs.items():
        ratio = _ratio(r["time_to_target_s"], reference)
        scenario = name.split("/")[0]
        pp = None if sync_acc.get(scenario) is None else 100 * (r["final_acc"] - sync_acc[scenario])
        stale = f"{max(r['staleness'])}/{r['bound']}" if r["staleness"] else "-"
        t.add_row(name, "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                  "-" if ratio is None else f"{ratio:.2f}x",
                  f"{data['bounds'][scenario]:.2f}x" if scenario in data.get("bounds", {}) else "-",
                  f"{r['final_acc']:.3f}",
                  "-" if pp is None else f"{pp:+.1f}", stale, str(r["exchanges"] or "-"))
    return t


def plot(dataset: str, data: dict[str, Any], stem: Path) -> str:
    plt = pyplot()
    runs = data["runs"]
    grouped = [(n, r) for n, r in runs.items() if r["staleness"]]
    fig, axes = plt.subplots(1, 2 + (1 if grouped else 0), figsize=(16 if grouped else 11, 4))
    for axis, scenario in zip(axes, ("straggler", "stall")):
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
        axis.set_xlabel("staleness: exchanges ahead of the slowest group")
        axis.set_ylabel("share of exchanges")
        axis.set_title("staleness histogram (parameter service)")
        axis.legend(fontsize=7)
    fig.tight_layout()
    path = stem.parent / f"{stem.name}_{dataset}.png"
    save(fig, path)
    return str(path)


EXCHANGE_SIZES = (1_000_000, 10_000_000, 25_000_000)
# (label, codec, shared memory): TCP with each codec, and a leader on the service's node
EXCHANGE_PATHS = (("tcp fp32", "fp32", False), ("tcp fp16", "fp16", False), ("tcp topk 1%", "topk", False),
                  ("shared memory", "fp32", True))


def exchange_cost(console: Console, sizes: tuple[int, ...] = EXCHANGE_SIZES) -> list[dict[str, Any]]:
    """One leader's exchange with the service process rank 0 would start (its default state directory),
    over loopback TCP with each codec and through shared memory, by model size. A leader pushes a model
    that moved since its last answer and waits for the new one: the figure is the whole call."""
    import torch

    from crossover.plugins.group_async.codec import Codec
    from crossover.plugins.group_async.link import ServiceLink, ServiceProcess

    rows = []
    for numel in sizes:
        for group, (label, kind, shared) in enumerate(EXCHANGE_PATHS):
            service = ServiceProcess("127.0.0.1", 4)
            try:
                _, port = service.start()
                link = ServiceLink(("127.0.0.1", port), service.token, group=group, codec=Codec(kind, 0.01),
                                   **({"shared_memory": True} if shared else {}))
                model = torch.zeros(numel)
                link.start(model)
                if shared and not getattr(link, "local", False):
                    console.print(f"  {label}: not available here; skipped")
                    link.close()
                    continue
                times = []
                for _ in range(3 + (4 if numel >= 10_000_000 else 12)):
                    model.add_(0.001)
                    started = time.perf_counter()
                    link.exchange(model, wait=True)
                    times.append(time.perf_counter() - started)
                link.close()
            finally:
                service.stop()
            times = sorted(times[3:])  # the first three map fresh pages
            p50 = times[len(times) // 2]
            rows.append({"params": numel, "mb_fp32": numel * 4 / 1e6, "path": label, "codec": kind,
                         "shared_memory": shared, "exchange_ms_p50": 1e3 * p50,
                         "exchange_ms_min": 1e3 * times[0], "exchange_ms_max": 1e3 * times[-1],
                         "model_gb_per_s": numel * 4 / p50 / 1e9, "repeats": len(times)})
            console.print(f"  {numel:>11,} params {label:>14}: {1e3 * p50:8.2f} ms "
                          f"({numel * 4 / p50 / 1e9:.2f} GB/s of model)")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="half the epochs (about 10 minutes per dataset)")
    p.add_argument("--datasets", default="digits", help="comma-separated: digits, mnist1d")
    p.add_argument("--pace", default="auto", help="device emulation factor, or auto (from the load average)")
    p.add_argument("--out", default="", help="output stem (default results/group_async[_quick])")
    p.add_argument("--exchange-cost", action="store_true", help="only time exchanges against model size")
    args = p.parse_args()
    console = Console()
    out = Path(args.out or ("results/group_async" + ("_quick" if args.quick else "")))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.exchange_cost:
        rows = exchange_cost(console)
        Path(f"{out}_exchange_cost.json").write_text(json.dumps(rows, indent=1))
        console.print(f"wrote {out}_exchange_cost.json")
        return
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "datasets": {}}
    with tempfile.TemporaryDirectory(prefix="crossover-ga-bench-") as tmp:
        for dataset in args.datasets.split(","):
            data = run_dataset(dataset, args, console, Path(tmp))
            results["datasets"][dataset] = data
            data["plot"] = plot(dataset, data, out)
            console.print(table(dataset, data))
            console.print(f"plot: {data['plot']}")
    Path(f"{out}.json").write_text(json.dumps(results, indent=1))
    console.print(f"wrote {out}.json")


if __name__ == "__main__":
    main()
