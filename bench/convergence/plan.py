"""What the convergence benchmark runs: its dataset/model pairs per scenario group (`FULL`, `--quick`'s
`QUICK`) and the plan that turns them into one run list per dataset (`bench/convergence/` explains the
scenarios)."""
from __future__ import annotations

import argparse
from typing import Any

# One entry per dataset/model pair and scenario group; `target` is the test accuracy to reach.
FULL = {
    "straggler": [
        {"dataset": "digits", "model": "cnn", "width": 512, "global_batch": 128, "lr": 0.05, "epochs": 8,
         "target": 0.98, "early_target": 0.95},
        {"dataset": "mnist1d", "model": "cnn", "width": 1024, "global_batch": 256, "lr": 0.1, "epochs": 12,
         "target": 0.80, "early_target": 0.50},
    ],
    "large_batch": [
        {"dataset": "digits", "model": "mlp", "width": 512, "base_batch": 32, "lr": 0.05, "epochs": 12,
         "target": 0.93},
        {"dataset": "mnist1d", "model": "mlp", "width": 512, "base_batch": 32, "lr": 0.05, "epochs": 12,
         "target": 0.55},
        {"dataset": "digits", "model": "cnn", "width": 256, "base_batch": 32, "lr": 0.05, "epochs": 12,
         "target": 0.90},
        {"dataset": "mnist1d", "model": "cnn", "width": 256, "base_batch": 32, "lr": 0.05, "epochs": 12,
         "target": 0.75},
    ],
}
QUICK = {
    "straggler": [
        {"dataset": "digits", "model": "cnn", "width": 512, "global_batch": 128, "lr": 0.05, "epochs": 8,
         "target": 0.98, "early_target": 0.95},
    ],
    "large_batch": [
        {"dataset": "digits", "model": "mlp", "width": 512, "base_batch": 32, "lr": 0.05, "epochs": 6,
         "target": 0.85},
    ],
}
STRAGGLER = "3:3.0"
LARGE = 8


def pair(entry: dict[str, Any]) -> str:
    return f"{entry['dataset']}-{entry['model']}"


def plan(config: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Run specs per dataset (one job each), tagged with scenario, pair and method."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for entry in config["straggler"]:
        common = {"model": entry["model"], "width": entry["width"], "global_batch": entry["global_batch"],
                  "lr": entry["lr"], "epochs": entry["epochs"], "target": entry["target"],
                  "early_target": entry["early_target"], "pace": None,
                  "straggler_work": args.straggler_work, "period": args.period, "method": args.method,
                  "ema_alpha": args.ema_alpha}
        runs = jobs.setdefault(entry["dataset"], [])
        if not runs:
            runs.append({**common, "name": "warmup", "rule": "average", "epochs": 1, "scenario": "warmup"})
        # A repeat's sync and LB-BSP runs train interleaved, a few steps of each in turn (evaluation to
        # evaluation), which goes first alternating between repeats, so the machine's load, which drifts
        # by tens of percent within seconds here, hits both alike. With --also-method the straggler's
        # three runs go back to back in a rotated order instead: two LB-BSP runs cannot share a
        # process's newest-sampler link.
        for repeat in range(args.repeats):
            for scenario, straggler in (("straggler", STRAGGLER), ("no_straggler", "")):
                if scenario not in entry.get("scenarios", ("straggler", "no_straggler")):
                    continue
                order: list[tuple[str, str, dict[str, Any]]] = [("sync", "average", {}), ("lbbsp", "weighted", {})]
                together: dict[str, Any] = {"interleave": f"{scenario}/{pair(entry)}#{repeat}",
                                            "interleave_order": [repeat % 2, 1 - repeat % 2]}
                if scenario == "straggler" and args.also_method:
                    order.append((f"lbbsp-{args.also_method}", "weighted", {"method": args.also_method}))
                    shift = repeat % len(order)
                    order, together = order[shift:] + order[:shift], {}
                for method, rule, extra in order:
                    runs.append({**common, **extra, **together,
                                 "name": f"{scenario}/{pair(entry)}/{method}#{repeat}", "rule": rule,
                                 "straggler": straggler, "scenario": scenario, "pair": pair(entry),
                                 "variant": method, "repeat": repeat})
    for entry in config["large_batch"]:
        common = {"model": entry["model"], "width": entry["width"], "lr": entry["lr"], "epochs": entry["epochs"],
                  "target": entry["target"], "pace": 0.0, "evals_per_epoch": 1}
        runs = jobs.setdefault(entry["dataset"], [])
        base, large = entry["base_batch"], LARGE * entry["base_batch"]
        variants = [(f"average@{large}", "average", large), (f"adasum@{large}", "adasum", large)]
        if args.base_reference:
            variants.insert(0, (f"average@{base}", "average", base))
        for method, rule, batch in variants:
            runs.append({**common, "name": f"large_batch/{pair(entry)}/{method}", "rule": rule, "global_batch": batch,
                         "scenario": "large_batch", "pair": pair(entry), "variant": method})
    return jobs
