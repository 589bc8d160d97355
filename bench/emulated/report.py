"""What the emulated-cluster benchmark (`bench/emulated/`) shows: the table of its scenarios' medians and
the timeline of the first cycle's segments (which job held each node's device when)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from bench.emulated.judge import phase_intervals
from bench.emulated.scenarios import COLOCATED, MODES, POLICY
from bench.lib.plot import pyplot, save


def plot_timeline(raw: dict[str, Any], path: Path, title: str, seconds: float) -> None:
    """Per mode (first cycle), per node: each job's compute phases (solid) and comm phases (light)."""
    plt = pyplot()
    segs = {s["mode"]: s for s in reversed(raw["segments"])}  # the first segment of each mode
    solo = raw["solos"][0]
    panels = [("sequential", solo["events"], solo["segment"])] + [(m, raw["events"], segs[m]) for m in COLOCATED
                                                                   if m in segs]
    jobs = sorted(raw["jobs"]) + sorted(raw.get("visitors", {}))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 2.4 * len(panels)), squeeze=False)
    colors = [f"C{i}" for i in range(10)]  # matplotlib's default cycle
    for ax, (mode, events, seg) in zip(axes[:, 0], panels):
        lo = seg["a"]
        hi = lo + seconds
        labels, ticks, y = [], [], 0.0
        segs[mode] = seg
        for node in sorted(events):
            comp = phase_intervals(events[node])
            comm = phase_intervals(events[node], frozenset({"comm"}))
            for k, job in enumerate(jobs):
                c = colors[k % len(colors)]
                if job not in comp and job not in comm:  # a job placed on other nodes
                    continue
                if job in raw.get("visitors", {}) and job not in segs[mode]["running"]:
                    continue
                if job not in segs[mode]["running"]:
                    labels.append(f"{node} dev0 {job} (not running)")
                    ticks.append(y + 0.5)
                    y += 1
                    continue
                ax.broken_barh([(a - lo, b - a) for a, b in comp.get(job, []) if b > lo and a < hi],
                               (y + 0.1, 0.8), facecolors=c)
                ax.broken_barh([(a - lo, b - a) for a, b in comm.get(job, []) if b > lo and a < hi],
                               (y + 0.35, 0.3), facecolors=c, alpha=0.3, hatch="///", edgecolor=c)
                labels.append(f"{node} dev0 {job}")
                ticks.append(y + 0.5)
                y += 1
            y += 0.4
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xlim(0, seconds)
        ax.set_ylim(y, 0)
        what = "one job alone (solo run)" if mode == "sequential" else f"policy {POLICY[mode]}"
        ax.set_title(f"{mode}: {what}; solid = compute (holds the device), light = allreduce",
                     fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds into the segment")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save(fig, path)


def render(summaries: list[dict[str, Any]], host_wait: str, nice: int, device: str = "1 core = 1 device per node"
           ) -> Table:
    """One section per scenario: each mode's medians over cycles, then the pipeline bound."""
    t = Table(title=f"Crossover on an emulated cluster ({device}, tbf links, host wait "
                    f"{host_wait}, nice {nice}); medians over cycles",
              caption="samples/s: aggregate over running jobs; ×unsched/×seq: vs the unscheduled and the one-alone "
                      "segment of the same cycle; ±: the farthest cycle's ×unsched from the median; "
                      "% bound: vs Σbatch/max(ΣC,ΣM,T) with C, M, T measured alone; "
                      "progress: each job's speed vs alone (1/slowdown), summed, vs unscheduled in the same cycle "
                      "(unlike samples/s, it does not weigh the large batches most); "
                      "slowdown: iteration vs alone; busy: union of compute phases / wall; fair: max/min slowdown; "
                      "same order: share of consecutive grants node1 made in node0's order; gap: release→next grant; "
                      "wait max: longest grant wait in any cycle; "
                      "stalled: segments where a job finished <3 iterations; "
                      "load: 1-min load average of the shared machine")
    for c in ("scenario", "mode", "samples/s", "×unsched", "±", "×seq", "progress", "% bound",
              "iter ms (slowdown) per job",
              "busy %", "fair", "same order", "gap p50/p90 ms", "wait max ms", "load"):
        t.add_column(c, justify="left" if c in ("scenario", "mode") else "right")

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for s in summaries:
        head = (f"{s['scenario']}\n{s['rate_mbit']:.0f} Mbit/s, batch {s['batch']}\nalone C {s['alone_C_ms']:.0f} "
                f"M {s['alone_M_ms']:.0f} ms\nmeasured M:C {s['measured_ratio']:.2f}")
        if s.get("visitor"):
            head += "\n+1 job arrives and leaves in every segment"
        if s.get("placement"):
            head += f"\n{s['nodes']} nodes: " + " ".join(f"job{k}@{'+'.join(map(str, p))}"
                                                         for k, p in enumerate(s["placement"]))
        for i, mode in enumerate(m for m in MODES if m in s["modes"]):
            r = s["modes"][mode]
            per = " ".join(f"{1000 * j['iter_s']:.0f}({j['slowdown']:.2f})" for _, j in sorted(r["jobs"].items()))
            if r["stalled_segments"]:
                per += f" [{r['stalled_segments']}/{r['cycles']} stalled]"
            t.add_row(head if i == 0 else "", mode, f(r["aggregate_samples_per_s"], ".0f"),
                      f(r["vs_unscheduled"], ".2f"),
                      "-" if mode in ("sequential", "unscheduled") or r.get("vs_unscheduled_spread") is None
                      else f"{100 * r['vs_unscheduled_spread']:.1f}%",
                      f(r["vs_sequential"], ".2f"), f(r.get("progress_vs_unscheduled"), ".2f"),
                      f(None if r["of_bound"] is None else 100 * r["of_bound"], ".0f") + "%", per,
                      f(None if r["busy_fraction_mean"] is None else 100 * r["busy_fraction_mean"], ".0f"),
                      f(r["fairness"], ".2f") if mode != "sequential" else "-",
                      f(None if r["turn_agreement"] is None else 100 * r["turn_agreement"], ".0f"),
                      f"{f(r['gap_ms_p50'], '.1f')}/{f(r['gap_ms_p90'], '.1f')}", f(r["wait_ms_worst"], ".0f"),
                      f(r["load1"], ".1f"))
        t.add_row("", "bound", f"{s['bound_samples_per_s']:.0f}", "", "", "", "", "100%", "", "", "", "", "", "", "",
                  end_section=True)
    return t
