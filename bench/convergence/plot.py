"""Plots of the convergence benchmark: test accuracy over training time and over epochs, one PNG per
scenario group and dataset/model pair."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib.plot import pyplot, save


def plots(results: dict[str, Any], stem: Path) -> list[str]:
    """Write `<stem>_<scenario>_<pair>.png` for each group of runs; the paths written."""
    plt = pyplot()
    written = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results.values():
        key = ("straggler" if r["scenario"] in ("straggler", "no_straggler") else r["scenario"], r["pair"])
        groups.setdefault(key, []).append(r)
    for (scenario, name), runs in groups.items():
        fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4))
        for r in runs:
            label = f"{r['scenario']}/{r['method']}" if scenario == "straggler" else r["method"]
            label += f" #{r['repeat']}" if r["repeat"] else ""
            style = "--" if r["scenario"] == "no_straggler" else "-"
            epochs = [p[0] for p in r["curve"]]
            seconds = [p[2] for p in r["curve"]]
            accs = [p[3] for p in r["curve"]]
            by_time.plot(seconds, accs, style, marker=".", label=label)
            by_epoch.plot(epochs, accs, style, marker=".", label=label)
        for axis, xlabel in ((by_time, "training wall time (s, evaluation excluded)"), (by_epoch, "epoch")):
            axis.axhline(runs[0]["target"], color="grey", linewidth=0.8, linestyle=":")
            if runs[0].get("early_target") is not None:
                axis.axhline(runs[0]["early_target"], color="lightgrey", linewidth=0.8, linestyle=":")
            axis.set_xlabel(xlabel)
            axis.set_ylabel("test accuracy")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        fig.suptitle(f"{scenario}: {name} (4 ranks, target {runs[0]['target']:.2f})")
        fig.tight_layout()
        path = stem.parent / f"{stem.name}_{scenario}_{name}.png"
        save(fig, path)
        written.append(str(path))
    return written
