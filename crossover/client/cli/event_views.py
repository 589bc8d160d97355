"""What `crossover stats` and `crossover timeline` show of an event log's phases: tables and a picture.

matplotlib is imported only inside `draw_timeline`, so the rest of the CLI starts fast and works
without it (it is the `plots` extra).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from crossover.client.cli.event_intervals import DeviceKey, Interval, PhaseLog, Stats, job_labels
from crossover.client.cli.formatting import JSON_VERSION, shown

__all__ = ["draw_timeline", "stats_json", "stats_tables"]


def stats_json(stats: Stats, log: PhaseLog) -> dict[str, Any]:
    """`{"version": JSON_VERSION, "kind": "stats", ...}`: the window in seconds since the first event, then every
    row."""
    return {"version": JSON_VERSION, "kind": "stats",
            "window": {"since_s": stats.since - log.first, "until_s": stats.until - log.first,
                       "log_s": log.last - log.first},
            "jobs": [dataclasses.asdict(j) for j in stats.jobs], "sharing_gain": stats.sharing_gain,
            "devices": [dataclasses.asdict(d) for d in stats.devices]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def stats_tables(stats: Stats, log: PhaseLog) -> list[Table]:
    """One table of jobs, one of devices."""
    since, until = stats.since - log.first, stats.until - log.first
    jobs = Table(title=f"jobs, {since:.1f} s to {until:.1f} s of {log.last - log.first:.1f} s", title_justify="left",
                 caption="compute and comm: total s, mean ms per interval; wait: request to grant; "
                         "share: compute / the ranks' active time", caption_justify="left")
    jobs.add_column("job", no_wrap=True)
    jobs.add_column("id", no_wrap=True)
    for col in ("ranks", "iters", "compute s", "mean ms", "comm s", "mean ms", "wait s", "mean ms", "p95 ms",
                "max ms", "share"):
        jobs.add_column(col, justify="right", no_wrap=True)
    for j in stats.jobs:
        jobs.add_row(shown(j.job_name), shown(j.job_id[:12]), ",".join(map(str, j.ranks)), str(j.iterations),
                     f"{j.compute_total_s:.2f}", _ms(j.compute_mean_s), f"{j.comm_total_s:.2f}", _ms(j.comm_mean_s),
                     f"{j.wait_total_s:.2f}", _ms(j.wait_mean_s), _ms(j.wait_p95_s), _ms(j.wait_max_s),
                     f"{100 * j.compute_share:.0f}%")
    sharing = Table(title=f"what sharing cost each job, and bought: {stats.sharing_gain:.2f} jobs' worth of "
                          "iterations in all", title_justify="left",
                    caption="iter ms: per iteration here; alone ms: mean compute + mean comm, an estimate of the "
                            "job with its devices to itself; slower: iter / alone; jobs' worth: the jobs' speeds "
                            "against alone, each times the share of the window it was there, added up (over 1: "
                            "sharing beat running them one after another)",
                    caption_justify="left")
    sharing.add_column("job", no_wrap=True)
    for col in ("iter ms", "alone ms", "slower"):
        sharing.add_column(col, justify="right", no_wrap=True)
    for j in stats.jobs:
        sharing.add_row(shown(j.job_name), _ms(j.iteration_s), _ms(j.alone_s),
                        f"{j.slowdown:.2f}x" if j.slowdown else "-")
    devices = Table(title="devices", title_justify="left",
                    caption="busy: time some rank computed on it / the window", caption_justify="left")
    devices.add_column("node", no_wrap=True)
    for col in ("device", "busy", "grants"):
        devices.add_column(col, justify="right", no_wrap=True)
    devices.add_column("holders")
    for d in stats.devices:
        devices.add_row(shown(d.node), str(d.device), f"{100 * d.busy_fraction:.0f}%", str(d.grants),
                        shown(", ".join(d.holders), 200) if d.holders else Text("none", style="dim"))
    return [jobs, sharing, devices]


def _label(value: str, limit: int = 40) -> str:
    """A name someone chose, as literal matplotlib text (no control characters, no mathtext)."""
    return shown(value, limit).plain.replace("$", r"\$")


def draw_timeline(intervals: Sequence[Interval], since: float, until: float, path: Path, *,
                  devices: Iterable[DeviceKey] = (), marks: Sequence[tuple[float, str]] = (), title: str = "",
                  origin: float = 0.0) -> Path:
    """Draw one band per node and device, one row per rank on it, and write a PNG to `path`.

    Each job has one color: compute (the rank holds the device) solid, its allreduce hatched and
    light, waiting for a grant as a thin pale bar, an overdue holder cross-hatched with a red edge.
    `intervals` are already clipped to [since, until]; `devices` adds bands for devices idle there;
    `marks` (t, text) are drawn as labelled vertical lines (policy switches); the x axis is seconds
    after `origin`. Raises ImportError without matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    jobs = {iv.job: iv.job_name for iv in sorted(intervals, key=lambda iv: (iv.job_name, iv.job))}
    names = job_labels(jobs)
    colors = {job: f"C{i % 10}" for i, job in enumerate(jobs)}
    rows: dict[DeviceKey, dict[tuple[str, int], list[Interval]]] = {key: {} for key in devices}
    for iv in intervals:
        rows.setdefault(iv.device_key, {}).setdefault((iv.job, iv.rank), []).append(iv)
    n_rows = sum(max(1, len(r)) for r in rows.values())

    fig = Figure(figsize=(14, max(2.5, 1.4 + 0.32 * n_rows + 0.25 * len(rows))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels: list[str] = []
    ticks: list[float] = []
    y = 0.0
    for (node, device), ranks in sorted(rows.items()):
        where = f"{_label(node)} dev{device}"
        if not ranks:
            labels.append(f"{where} (idle)")
            ticks.append(y + 0.5)
            y += 1
        for (job, rank), ivs in sorted(ranks.items(), key=lambda kv: (names[kv[0][0]], kv[0][1])):
            c = colors[job]
            bars: dict[str, list[tuple[float, float]]] = {}
            for iv in ivs:
                if iv.end > iv.start:
                    bars.setdefault(iv.phase, []).append((iv.start - origin, iv.length))
            ax.broken_barh(bars.get("wait", []), (y + 0.44, 0.12), facecolors=c, alpha=0.3, linewidth=0)
            ax.broken_barh(bars.get("comm", []), (y + 0.3, 0.4), facecolors=c, alpha=0.35, hatch="///",
                           edgecolor=c, linewidth=0)
            ax.broken_barh(bars.get("compute", []), (y + 0.1, 0.8), facecolors=c, linewidth=0)
            ax.broken_barh(bars.get("overdue", []), (y + 0.1, 0.8), facecolors=c, hatch="xx", edgecolor="red",
                           linewidth=0.8)
            ax.broken_barh(bars.get("suspended", []), (y + 0.25, 0.5), facecolors="none", edgecolor="red",
                           linestyle=":", linewidth=1.0)
            labels.append(f"{where}  {_label(names[job])} r{rank}")
            ticks.append(y + 0.5)
            y += 1
        ax.axhline(y + 0.2, color="0.8", linewidth=0.6)
        y += 0.4
    _draw_marks(ax, marks, since, until, origin)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(max(y - 0.4, 1), 0)
    ax.set_xlim(since - origin, until - origin)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=_legend(intervals, {_label(names[j]): colors[j] for j in jobs}), loc="upper left",
              bbox_to_anchor=(1.005, 1), fontsize=8, frameon=False)
    if title:
        ax.set_title(_label(title, 200), fontsize=10, loc="left")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _draw_marks(ax: Any, marks: Sequence[tuple[float, str]], since: float, until: float, origin: float) -> None:
    """Each mark (t, text) inside the window as a labelled dashed line; marks closer than a label's width
    go one line lower."""
    level_free_at = [float("-inf")] * 4
    for t, text in sorted(marks):
        if since <= t <= until:
            x = t - origin
            level = next((k for k, free in enumerate(level_free_at) if x >= free), 0)
            level_free_at[level] = x + (until - since) * 0.012 * (len(text) + 2)
            ax.axvline(x, color="0.3", linestyle="--", linewidth=0.8)
            ax.text(x, 0.995 - 0.05 * level, f" {_label(text)}", fontsize=7, va="top", ha="left", color="0.2",
                    transform=ax.get_xaxis_transform(),
                    bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})


def _legend(intervals: Sequence[Interval], job_colors: dict[str, str]) -> list[Any]:
    """One patch per job, then one per kind of phase drawn (overdue and suspended only where there are any)."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=color, label=label) for label, color in job_colors.items()]
    handles += [Patch(facecolor="0.4", label="compute (holds the device)"),
                Patch(facecolor="0.4", alpha=0.35, hatch="///", edgecolor="0.4", label="allreduce"),
                Patch(facecolor="0.4", alpha=0.3, label="waiting for a grant")]
    if any(iv.phase == "overdue" for iv in intervals):
        handles.append(Patch(facecolor="0.4", hatch="xx", edgecolor="red", label="overdue (served past)"))
    if any(iv.phase == "suspended" for iv in intervals):
        handles.append(Patch(facecolor="none", edgecolor="red", linestyle=":", label="suspended (silent)"))
    return handles
