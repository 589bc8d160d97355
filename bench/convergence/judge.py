"""Judging the convergence benchmark: each run's figures from its accuracy curve (time and epochs to the
target, settled step time, training time with machine stalls capped) and the checks over the repeats of
a scenario (`compare`), with ratios taken per repeat and the median over repeats checked."""
from __future__ import annotations

import statistics
from typing import Any, Optional

from bench.convergence.plan import LARGE


def first_reaching(curve: list[list[float]], target: float) -> Optional[list[float]]:
    """The first evaluation point (epoch, step, train seconds, acc, loss) at or above ``target``."""
    return next((point for point in curve if point[3] >= target), None)


def size_imbalance(history: Optional[list], steps: int) -> Optional[float]:
    """Step-weighted mean of ``max(b_i) / (B/n) - 1``: how much longer the largest per-rank batch made
    each step than an even split would, for equally fast ranks (a load-independent cost bound)."""
    if not history or steps <= 0:
        return None
    total = 0.0
    bounds = [int(start) for start, _ in history[1:]] + [steps]
    for (start, sizes), end in zip(history, bounds):
        span = max(0, min(end, steps) - int(start))
        total += span * (max(sizes) * len(sizes) / sum(sizes) - 1.0)
    return total / steps


def settled_step_ms(curve: list[list[float]]) -> Optional[float]:
    """Training milliseconds per step over the second half of the run (the sizes have settled by then)."""
    last = curve[-1]
    middle = next((point for point in curve if point[1] >= last[1] / 2), None)
    if middle is None or last[1] <= middle[1]:
        return None
    return 1000 * (last[2] - middle[2]) / (last[1] - middle[1])


STALL_CAP = 3.0  # an evaluation interval longer than this many median intervals holds a machine stall


def steady_curve(curve: list[list[float]], cap: float = STALL_CAP) -> list[list[float]]:
    """The curve on a clock whose evaluation intervals are capped at ``cap`` times the run's median
    seconds per step: the run without the machine's multi-second stalls, which land at random (in sync
    runs as often as in LB-BSP ones, often in both runs of an interleaved pair at once, and in plain
    Horovod with no Crossover code) and can add a third to a short run at the same sizes and updates as
    its partner. What a method costs itself shows in every interval."""
    spans = [(b[2] - a[2], b[1] - a[1]) for a, b in zip(curve, curve[1:]) if b[1] > a[1]]
    if not spans:
        return [list(point) for point in curve]
    per_step = statistics.median(seconds / steps for seconds, steps in spans)
    out = [list(curve[0])]
    for a, b in zip(curve, curve[1:]):
        seconds, steps = b[2] - a[2], b[1] - a[1]
        capped = min(seconds, cap * per_step * steps) if steps > 0 else seconds
        out.append([b[0], b[1], out[-1][2] + capped, *b[3:]])
    return out


def steady_train_s(curve: list[list[float]], cap: float = STALL_CAP) -> Optional[float]:
    """Training seconds with machine stalls capped (see `steady_curve`); None for a curve of one point."""
    return steady_curve(curve, cap)[-1][2] if len(curve) > 1 else None


def steady_time_to_target_s(curve: list[list[float]], target: float) -> Optional[float]:
    """Seconds to ``target`` on the clock with machine stalls capped (see `steady_curve`); None if never reached."""
    hit = first_reaching(steady_curve(curve), target)
    return hit[2] if hit else None


def last_epoch_acc(curve: list[list[float]], epochs: float) -> float:
    """Mean test accuracy over the last epoch's evaluations: a single evaluation at the end of a
    run moves by 1-4 pp between neighbours on mnist1d, more than the methods differ."""
    last = [point[3] for point in curve if point[0] > epochs - 1] or [curve[-1][3]]
    return sum(last) / len(last)


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    spec = run["spec"]
    hit = first_reaching(run["curve"], spec["target"])
    early = first_reaching(run["curve"], spec["early_target"]) if spec.get("early_target") is not None else None
    lbbsp = run.get("lbbsp") or {}
    step_s = lbbsp.get("step_s") or 0.0
    weighted = spec.get("rule") == "weighted"  # every run has a sampler; only these have a controller at work
    return {
        "scenario": spec["scenario"], "pair": spec.get("pair"), "method": spec.get("variant"),
        "repeat": spec.get("repeat", 0),
        "aggregation": run["aggregation"], "target": spec["target"], "final_acc": run["final_acc"],
        "last_epoch_acc": last_epoch_acc(run["curve"], spec["epochs"]),
        "train_s": run["train_s"], "steps": run["steps"], "epochs": spec["epochs"],
        "time_to_target_s": hit[2] if hit else None, "epochs_to_target": hit[0] if hit else None,
        "steady_time_to_target_s": steady_time_to_target_s(run["curve"], spec["target"]),
        "early_target": spec.get("early_target"), "time_to_early_target_s": early[2] if early else None,
        "settled_step_ms": settled_step_ms(run["curve"]),
        "steady_train_s": steady_train_s(run["curve"]),
        "final_sizes": lbbsp.get("sizes"), "size_history": lbbsp.get("history"),
        "size_imbalance": size_imbalance(lbbsp.get("history"), run["steps"]),
        "controller_overhead": lbbsp.get("overhead_s", 0.0) / step_s if step_s and weighted else None,
        "curve": run["curve"],
        "trace": lbbsp.get("trace") if weighted else None,
        "lbbsp_config": lbbsp.get("config") if weighted else None,
        "lbbsp_min_gain": lbbsp.get("min_gain") if weighted else None,
    }


def _mean(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return None if not values or len(known) < len(values) else sum(known) / len(known)


def aggregate(results: dict[str, Any], scenario: str, name: str, method: str) -> dict[str, Optional[float]]:
    """Means over the repeats of one (scenario, pair, method)."""
    runs = [r for r in results.values() if (r["scenario"], r["pair"], r["method"]) == (scenario, name, method)]
    return {
        "time_to_target_s": _mean([r["time_to_target_s"] for r in runs]),
        "steady_time_to_target_s": _mean([r.get("steady_time_to_target_s") for r in runs]),
        "train_s": _mean([r["train_s"] for r in runs]),
        "steady_train_s": _mean([r.get("steady_train_s") for r in runs]),
        "final_acc": _mean([r["final_acc"] for r in runs]),
        "last_epoch_acc": _mean([r.get("last_epoch_acc") for r in runs]),
        "controller_overhead": max((r["controller_overhead"] for r in runs if r["controller_overhead"] is not None),
                                   default=None),
        "size_imbalance": _mean([r["size_imbalance"] for r in runs]),
        "repeats": len(runs),
    }


def paired_ratios(results: dict[str, Any], scenario: str, name: str, key: str, variant: str = "lbbsp"
                  ) -> list[float]:
    """``sync / variant`` of ``key`` per repeat (they ran back to back), in repeat order."""
    by_repeat: dict[int, dict[str, Any]] = {}
    for r in results.values():
        if (r["scenario"], r["pair"]) == (scenario, name):
            by_repeat.setdefault(r["repeat"], {})[r["method"]] = r
    ratios = []
    for repeat in sorted(by_repeat):
        runs = by_repeat[repeat]
        if "sync" in runs and variant in runs and runs["sync"].get(key) and runs[variant].get(key):
            ratios.append(runs["sync"][key] / runs[variant][key])
    return ratios


def _ratios(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x of " + " ".join(f"{v:.2f}" for v in values)


def _straggler_rows(results: dict[str, Any], name: str, sync: dict[str, Any], lbbsp: dict[str, Any]
                    ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    target = next(r["target"] for r in results.values() if r["pair"] == name and r["scenario"] == "straggler")
    speedups = paired_ratios(results, "straggler", name, "steady_time_to_target_s")
    if speedups and len(speedups) == sync["repeats"]:
        speedup = statistics.median(speedups)
        rows.append({"check": f"{name}: straggler, time to target {target:.2f} (LB-BSP sooner by >= 1.5x, "
                              "machine stalls capped)",
                     "value": f"{_ratios(speedups)} (means {sync['steady_time_to_target_s']:.1f} s vs "
                              f"{lbbsp['steady_time_to_target_s']:.1f} s)", "met": speedup >= 1.5})
        raw = paired_ratios(results, "straggler", name, "time_to_target_s")
        rows.append({"check": f"{name}: straggler, raw time to target (reported)", "value": _ratios(raw),
                     "met": None})
    else:
        rows.append({"check": f"{name}: straggler, time to target", "value": "target not reached", "met": False})
    early = paired_ratios(results, "straggler", name, "time_to_early_target_s")
    if early:
        rows.append({"check": f"{name}: straggler, time to the early target (reported)",
                     "value": _ratios(early), "met": None})
    settled = paired_ratios(results, "straggler", name, "settled_step_ms")
    if settled:
        rows.append({"check": f"{name}: straggler, step time once sizes settled (reported)",
                     "value": _ratios(settled), "met": None})
    gap = 100 * abs(sync["last_epoch_acc"] - lbbsp["last_epoch_acc"])  # type: ignore[operator]
    rows.append({"check": f"{name}: straggler, final accuracy within 0.5 pp (mean over the last epoch)",
                 "value": f"{gap:.2f} pp ({100 * sync['last_epoch_acc']:.2f} vs "  # type: ignore[operator]
                          f"{100 * lbbsp['last_epoch_acc']:.2f})", "met": gap <= 0.5})
    single = 100 * abs(sync["final_acc"] - lbbsp["final_acc"])  # type: ignore[operator]
    rows.append({"check": f"{name}: straggler, gap at the single last evaluation (reported)",
                 "value": f"{single:.2f} pp", "met": None})
    others = sorted({r["method"] for r in results.values() if (r["scenario"], r["pair"]) == ("straggler", name)}
                    - {"sync", "lbbsp"})
    for variant in others:  # --also-method: measured beside the checked LB-BSP, reported only
        for key, what in (("time_to_target_s", "time to target"), ("settled_step_ms", "settled step time")):
            ratios = paired_ratios(results, "straggler", name, key, variant)
            if ratios:
                rows.append({"check": f"{name}: straggler, {variant}, {what} (reported)", "value": _ratios(ratios),
                             "met": None})
    return rows


NO_COST_PCT = 3.0  # LB-BSP without a straggler must not cost more than this


def cost_interval(costs: list[float]) -> tuple[float, float]:
    """The mean of per-repeat costs (%) and twice its standard error (about a 95 % interval).

    The no-straggler check fails when even the interval's low end is above ``NO_COST_PCT``: LB-BSP is
    then slower beyond the machine's noise. A 2-core VM running 4 ranks jitters each step by tens of
    percent, so one repeat's cost is known only to several percent (docs/benchmarks.md) and a point
    estimate against 3 % decides on noise. One repeat has no interval: its margin is 0.
    """
    mean = statistics.fmean(costs)
    margin = 2 * statistics.stdev(costs) / len(costs) ** 0.5 if len(costs) > 1 else 0.0
    return mean, margin


def compare(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, one row per check (``met`` None: reported, not a target). Speed checks use the
    median over repeats of ratios taken within a repeat; accuracies and overheads are means or worst cases."""
    rows: list[dict[str, Any]] = []
    pairs = sorted({r["pair"] for r in results.values() if r["scenario"] in ("straggler", "no_straggler")})
    for name in pairs:
        sync, lbbsp = aggregate(results, "straggler", name, "sync"), aggregate(results, "straggler", name, "lbbsp")
        if sync["repeats"]:
            rows += _straggler_rows(results, name, sync, lbbsp)
        plain = aggregate(results, "no_straggler", name, "sync")
        balanced = aggregate(results, "no_straggler", name, "lbbsp")
        # Judged on the training time without machine stalls (steady_train_s); the raw time beside it.
        for key, check, judged in (
                ("steady_train_s", f"LB-BSP not shown slower by > {NO_COST_PCT:g}% (machine stalls capped)", True),
                ("train_s", "raw training time, LB-BSP slower by (reported)", False)):
            costs = [100 * (1 / ratio - 1) for ratio in paired_ratios(results, "no_straggler", name, key)]
            if costs:
                mean, margin = cost_interval(costs)
                rows.append({"check": f"{name}: no straggler, {check}",
                             "value": f"mean {mean:+.1f}% ±{margin:.1f}, median {statistics.median(costs):+.1f}% of "
                                      + " ".join(f"{c:+.1f}" for c in costs)
                                      + f" (means {plain[key]:.1f} s vs {balanced[key]:.1f} s)",
                             "met": mean - margin <= NO_COST_PCT if judged else None})
        if balanced["size_imbalance"] is not None:
            bound = 100 * balanced["size_imbalance"]
            rows.append({"check": f"{name}: no straggler, cost of uneven sizes (load-independent bound) <= 3%",
                         "value": f"{bound:.1f}%", "met": bound <= 3.0})
        overheads = [r["controller_overhead"] for r in (lbbsp, balanced) if r["controller_overhead"] is not None]
        if overheads:
            worst = 100 * max(overheads)  # type: ignore[type-var]
            rows.append({"check": f"{name}: controller overhead < 1.1% of iteration time", "value": f"{worst:.2f}%",
                         "met": worst < 1.1})
    pairs = sorted({r["pair"] for r in results.values() if r["scenario"] == "large_batch"})
    for name in pairs:
        runs = {r["method"]: r for r in results.values() if r["scenario"] == "large_batch" and r["pair"] == name}
        avg = max((r for m, r in runs.items() if m.startswith("average@")), key=lambda r: _batch_of(r["method"]))
        ada = next(r for m, r in runs.items() if m.startswith("adasum@"))
        a, b = ada["epochs_to_target"], avg["epochs_to_target"]
        met = a is not None and (b is None or a < b)
        value = f"adasum {_fmt_epochs(a)} vs average {_fmt_epochs(b)} epochs"
        rows.append({"check": f"{name}: {LARGE}x batch, Adasum fewer epochs to target", "value": value, "met": met})
    return rows


def _batch_of(method: str) -> int:
    return int(method.split("@")[1])


def _fmt_epochs(value: Optional[float]) -> str:
    return "never" if value is None else f"{value:.2f}"

