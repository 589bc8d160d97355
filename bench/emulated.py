"""Crossover on an emulated cluster: co-located Horovod jobs, with and without scheduling.

Two nodes (network namespaces on one machine, `tools.cluster`), each with
one device (a CPU core its ranks are pinned to) and a tc-shaped link. Every
job is a real PyTorch MLP classifier trained data-parallel under Horovod
(tests/workloads/train_bench.py with `import crossover.auto` prepended), one
rank per node. A calibration measures compute time per sample and allreduce
time per link rate; each scenario picks the rate and batch that give the wanted
comm:compute ratio at about --iter-ms per iteration.

The machine is shared and its load swings within seconds, so the co-located
modes are measured *interleaved inside one run*: the jobs of a scenario start
once and train continuously while the harness switches the policy on both
daemons at once (SetPolicy), cycling through segments (order rotated each
cycle); each segment is measured after a settle time:

  unscheduled  policy `passthrough` (the plugin only observes)
  exclusive    one compute phase per device, FIFO
  crossover    cluster-consistent turns

and `sequential` (jobs one after another) comes from solo runs of the first job
before and of the last job after the co-located run (identical jobs: running
them one after another gives one job's alone throughput). Ratios are taken
within a cycle and the table shows medians over cycles.

Metrics: aggregate samples/s, each job's iteration time and slowdown vs alone,
device-busy fraction (union of compute intervals / wall, from the daemons'
event logs), the pipeline bound (identical jobs: Σbatch / max(ΣC, ΣM, T_alone),
C and M measured alone), and how often the two nodes granted in the same order.

    python -m bench.emulated                    # 4 scenarios (~15 min on 2 cores)
    python -m bench.emulated --quick            # 1:1 with two jobs (~3 min)
    python -m bench.emulated --host-wait spin   # stock Horovod waiting (see _POLL_SHIM)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.lib import ROOT, machine, write_json
from crossover.daemon.event_log import read_jsonl
from tools.cluster import Cluster, ClusterSpec, Link, preflight

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "train_bench.py"
MODES = ("sequential", "unscheduled", "exclusive", "crossover")
COLOCATED = MODES[1:]
POLICY = {"sequential": "passthrough", "unscheduled": "passthrough", "exclusive": "exclusive",
          "crossover": "crossover"}
console = Console(stderr=True)


@dataclass(frozen=True)
class Scenario:
    name: str
    ratio: float  # target comm:compute
    jobs: int


FULL = (Scenario("1:1 x2", 1.0, 2), Scenario("1:2 x2", 0.5, 2), Scenario("2:1 x2", 2.0, 2),
        Scenario("1:1 x3", 1.0, 3))
QUICK = (Scenario("1:1 x2", 1.0, 2),)

# Horovod 0.28.1's `synchronize()` waits for an allreduce in a sched_yield() loop
# (`horovod_torch_wait_and_clear`): a rank in its comm phase keeps its core ~95% busy
# (measured: 2.4 s of CPU in a 3 s wait). On a GPU that spin runs on a host core, not on
# the device; here the core *is* the device, so the spin steals the co-located job's
# compute. `--host-wait poll` prepends this shim (poll + 1 ms sleep; ~8% of a core)
# so the emulated device behaves like a GPU; `spin` runs stock Horovod.
_POLL_SHIM = """
import time as _xo_time
import horovod.torch.mpi_ops as _xo_ops
import horovod.torch.optimizer as _xo_opt

def _xo_sleep_sync(handle, _poll=_xo_ops.poll, _sync=_xo_opt.synchronize):
    while not _poll(handle):
        _xo_time.sleep(0.001)
    return _sync(handle)
_xo_opt.synchronize = _xo_sleep_sync
"""


# ---- running ----------------------------------------------------------------------------------------


def _script(workdir: Path, host_wait: str) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "xo_train_bench.py"
    shim = _POLL_SHIM if host_wait == "poll" else ""
    out.write_text("import crossover.auto\n" + shim + WORKLOAD.read_text())
    return out


def _job_cmd(script: Path, args: argparse.Namespace, batch: int, out: Path, seed: int,
             iters: int = 1_000_000, stop: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(script), "--iters", str(iters), "--batch", str(batch), "--width", str(args.width),
           "--depth", str(args.depth), "--in-dim", str(args.in_dim), "--seed", str(seed), "--out", str(out)]
    return cmd + (["--stop-file", str(stop)] if stop else [])


def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def calibrate(rate: float, batch: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One job alone for a few iterations: medians of its compute (grant→release) and comm phases."""
    script = _script(workdir, args.host_wait)
    with Cluster(ClusterSpec(nodes=2, link=Link(rate_mbit=rate), policy="passthrough", nice=args.nice),
                 workdir=workdir / "cluster") as cluster:
        job = cluster.run(_job_cmd(script, args, batch, workdir / "out", 1000, iters=16), name="calibration")
        if job.wait(args.job_timeout) != 0:
            raise RuntimeError(f"calibration failed:\n{job.output()[-3000:]}")
        events = [e for n in cluster.nodes for e in read_jsonl(n.event_log)]
    c = [e["held_s"] for e in events if e["event"] == "release" and "held_s" in e][8:]
    m = [e["duration_s"] for e in events if e["event"] == "comm_end"][8:]
    return {"rate_mbit": rate, "batch": batch, "C": statistics.median(c), "M": statistics.median(m),
            "params": _ranks(workdir / "out")[0]["params"]}


class _Admin:
    """SetPolicy on every daemon of the cluster, back to back over channels opened once."""

    def __init__(self, cluster: Cluster) -> None:
        import grpc

        from crossover.protos import crossover_v1_pb2 as pb
        from crossover.protos import crossover_v1_pb2_grpc as pb_grpc

        self._pb = pb
        from crossover.protos import admin_socket_path

        self._channels = [grpc.insecure_channel(f"unix://{admin_socket_path(n.socket)}") for n in cluster.nodes]
        self._stubs = [pb_grpc.AdminStub(ch) for ch in self._channels]

    def set_policy(self, name: str) -> None:
        req = self._pb.PolicyRequest(protocol_version=1, name=name)
        for stub in self._stubs:
            stub.SetPolicy(req, timeout=5)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


def run_solo(name: str, seed: int, rate: float, batch: int, args: argparse.Namespace, workdir: Path
             ) -> dict[str, Any]:
    """One job alone on a fresh cluster (policy passthrough): its iteration, compute and comm times."""
    script = _script(workdir, args.host_wait)
    with Cluster(ClusterSpec(nodes=2, link=Link(rate_mbit=rate), policy="passthrough", nice=args.nice),
                 workdir=workdir / "cluster") as cluster:
        job = cluster.run(_job_cmd(script, args, batch, workdir / f"out_{name}", seed, iters=args.solo_iters),
                          name=name)
        if job.wait(args.job_timeout) != 0:
            raise RuntimeError(f"solo {name} failed:\n{job.output()[-3000:]}")
        events = {n.name: read_jsonl(n.event_log) for n in cluster.nodes}
    ranks = _ranks(workdir / f"out_{name}")
    r0 = min(ranks, key=lambda r: r["rank"])
    its = list(zip(r0["iter_start"], r0["iter_end"]))[args.warmup:]
    lo, hi = its[0][0], its[-1][1]
    seg = {"cycle": -1, "mode": "sequential", "a": lo, "b": hi, "running": [name], "load1": os.getloadavg()[0]}
    return {"name": name, "events": events, "jobs": {name: ranks}, "segment": seg}


def run_scenario(scn: Scenario, rate: float, batch: int, args: argparse.Namespace, workdir: Path,
                 step: Callable[[str], None]) -> dict[str, Any]:
    """Solo run of the first job; all jobs co-located, cycling the policies as segments; solo run of the last job.

    Solo runs bracket the co-located run in time, so a drift of the machine's load shows up
    on both sides of the comparison. (Pausing jobs inside the co-located run would be more
    tightly interleaved, but leaves the paused job iterations behind, which a policy that
    orders by iteration count then pays back: an artifact, not the scenario.)
    """
    script = _script(workdir, args.host_wait)
    stop = workdir / "stop"
    spec = ClusterSpec(nodes=2, link=Link(rate_mbit=rate), policy="passthrough", nice=args.nice)
    names = [f"job{k}" for k in range(scn.jobs)]
    segments: list[dict[str, Any]] = []
    # The policy is edited while we measure: record which source the daemons loaded.
    policy_sha = hashlib.sha256((ROOT / "daemon" / "policies" / "crossover.py").read_bytes()).hexdigest()[:12]
    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batch}: {names[0]} alone")
    solos = [run_solo(names[0], 1000, rate, batch, args, workdir / "solo_first")]
    with Cluster(spec, workdir=workdir / "cluster") as cluster:
        jobs = [cluster.run(_job_cmd(script, args, batch, workdir / f"out_{n}", 1000 + k, stop=stop), name=n)
                for k, n in enumerate(names)]
        admin = _Admin(cluster)
        try:
            _wait_warm(cluster, jobs, names, args.warmup)
            for cycle in range(args.cycles):
                k = cycle % len(COLOCATED)
                for mode in COLOCATED[k:] + COLOCATED[:k]:
                    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batch}: cycle {cycle + 1}/{args.cycles} {mode}")
                    admin.set_policy(POLICY[mode])
                    t_switch = time.monotonic()
                    time.sleep(args.settle_s)
                    a = time.monotonic()
                    time.sleep(args.segment_s)
                    b = time.monotonic()
                    for j in jobs:
                        if j.poll() is not None:
                            raise RuntimeError(f"{j.name} exited during the run:\n{j.output()[-3000:]}")
                    segments.append({"cycle": cycle, "mode": mode, "switch": t_switch, "a": a, "b": b,
                                     "running": list(names), "load1": os.getloadavg()[0]})
        finally:
            admin.close()
            stop.touch()
        for j in jobs:
            if j.wait(args.job_timeout) != 0:
                raise RuntimeError(f"{j.name} failed:\n{j.output()[-3000:]}")
        events = {n.name: read_jsonl(n.event_log) for n in cluster.nodes}
    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batch}: {names[-1]} alone")
    solos.append(run_solo(names[-1], 1000 + len(names) - 1, rate, batch, args, workdir / "solo_last"))
    return {"scenario": scn.name, "rate_mbit": rate, "batch": batch, "segments": segments, "events": events,
            "policy_source_sha256": policy_sha, "solos": solos,
            "jobs": {n: _ranks(workdir / f"out_{n}") for n in names}}


def _wait_warm(cluster: Cluster, jobs: list[Any], names: list[str], warmup: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for j in jobs:
            if j.poll() is not None:
                raise RuntimeError(f"{j.name} exited before the measurement:\n{j.output()[-3000:]}")
        ends = [e.get("job_name") for e in cluster.events(0) if e["event"] == "comm_end"]
        if all(ends.count(n) >= warmup for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"jobs did not reach {warmup} iterations in {timeout:.0f}s")


# ---- analysis ---------------------------------------------------------------------------------------------


def _intervals(events: list[dict[str, Any]], start: str, end: str) -> dict[str, list[tuple[float, float]]]:
    """Per job name, [start, end) intervals of one phase on one node's event log."""
    open_: dict[tuple[str, int], float] = {}
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        key = (e.get("job_name", ""), e.get("rank", -1))
        if e["event"] == start:
            open_[key] = e["t"]
        elif e["event"] in (end, "leave") and key in open_:
            out.setdefault(key[0], []).append((open_.pop(key), e["t"]))
    return out


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, cur_a, cur_b = 0.0, 0.0, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def turn_agreement(ev0: list[dict[str, Any]], ev1: list[dict[str, Any]], lo: float, hi: float) -> float | None:
    """How often two nodes granted in the same order: over consecutive grants (job, iteration) of different
    jobs on node 0 within [lo, hi], the fraction that node 1 granted in the same relative order."""
    seq0 = [(e["job"], e["iteration"]) for e in ev0 if e["event"] == "grant" and lo <= e["t"] <= hi]
    pos1 = {(e["job"], e["iteration"]): i for i, e in enumerate(x for x in ev1 if x["event"] == "grant")}
    seq0 = [k for k in seq0 if k in pos1]
    pairs = [(a, b) for a, b in zip(seq0, seq0[1:]) if a[0] != b[0]]
    if not pairs:
        return None
    return sum(pos1[a] < pos1[b] for a, b in pairs) / len(pairs)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def analyse_segment(raw: dict[str, Any], seg: dict[str, Any]) -> dict[str, Any]:
    lo, hi = seg["a"], seg["b"]
    per_job: dict[str, dict[str, Any]] = {}
    aggregate = 0.0
    for name in seg["running"]:
        ranks = raw["jobs"][name]
        r0 = min(ranks, key=lambda r: r["rank"])
        ends = [t for t in r0["iter_end"] if lo <= t <= hi]
        # Mean time between iteration ends; a job that (nearly) stalled gets the window over what it did.
        stalled = len(ends) < 3
        iter_s = (ends[-1] - ends[0]) / (len(ends) - 1) if not stalled else (hi - lo) / max(len(ends), 0.5)
        gb = sum(r["batch"] for r in ranks)
        per_job[name] = {"iter_s": iter_s, "samples_per_s": gb / iter_s, "iters": len(ends), "stalled": stalled}
        aggregate += gb / iter_s
    busy, gaps, c_held, m_comm = {}, [], [], []
    for node, events in raw["events"].items():
        comp = _intervals(events, "grant", "release")  # a paused job may hold a passthrough grant: skip it
        busy[node] = _union_length([iv for job in seg["running"] for iv in comp.get(job, [])], lo, hi) / (hi - lo)
        last_release = None
        for e in events:
            if not lo <= e["t"] <= hi:
                continue
            if e["event"] == "release" and "held_s" in e:
                last_release = e["t"]
                c_held.append(e["held_s"])
            elif e["event"] == "grant" and last_release is not None:
                gaps.append(e["t"] - last_release)
                last_release = None
            elif e["event"] == "comm_end":
                m_comm.append(e["duration_s"])
    ev0, ev1 = raw["events"].values()
    return {"cycle": seg["cycle"], "mode": seg["mode"], "window_s": hi - lo, "load1": seg["load1"],
            "aggregate_samples_per_s": aggregate, "jobs": per_job,
            "busy_fraction_mean": statistics.fmean(busy.values()), "busy_fraction": busy,
            "turn_agreement": turn_agreement(ev0, ev1, lo, hi) if seg["mode"] != "sequential" else None,
            "gap_ms_p50": 1000 * _pct(gaps, 50), "gap_ms_p90": 1000 * _pct(gaps, 90),
            "C_ms": 1000 * statistics.median(c_held) if c_held else None,
            "M_ms": 1000 * statistics.median(m_comm) if m_comm else None}


def summarize(scn: Scenario, raw: dict[str, Any]) -> dict[str, Any]:
    """Per segment metrics; ratios within each cycle; medians over cycles; the pipeline bound."""
    segs = [analyse_segment(raw, s) for s in raw["segments"]]
    alone = [analyse_segment({**solo, "scenario": raw["scenario"]}, solo["segment"]) for solo in raw["solos"]]
    t_alone = statistics.median(j["iter_s"] for s in alone for j in s["jobs"].values())
    c_alone = statistics.median(s["C_ms"] for s in alone) / 1000
    m_alone = statistics.median(s["M_ms"] for s in alone) / 1000
    gb = sum(r["batch"] for r in next(iter(raw["jobs"].values())))
    n = scn.jobs
    bound = n * gb / max(n * c_alone, n * m_alone, t_alone)
    seq_aggregate = gb / t_alone  # identical jobs one after another: one job's throughput at a time
    cycles: dict[int, dict[str, dict[str, Any]]] = {}
    for s in segs:
        cycles.setdefault(s["cycle"], {})[s["mode"]] = s
    for cyc in cycles.values():
        seq = {**alone[0], "cycle": next(iter(cyc.values()))["cycle"], "aggregate_samples_per_s": seq_aggregate,
               "jobs": {j: v for a_ in alone for j, v in a_["jobs"].items()}}
        cyc["sequential"] = seq
        for s in cyc.values():
            for j in s["jobs"].values():
                j["slowdown"] = j["iter_s"] / t_alone
            slow = [j["slowdown"] for j in s["jobs"].values()]
            s["fairness"] = max(slow) / min(slow)
            s["vs_unscheduled"] = s["aggregate_samples_per_s"] / cyc["unscheduled"]["aggregate_samples_per_s"]
            s["vs_sequential"] = s["aggregate_samples_per_s"] / seq_aggregate
            s["of_bound"] = s["aggregate_samples_per_s"] / bound
    modes = {}
    for mode in MODES:
        rows = [c[mode] for c in cycles.values() if mode in c]
        med: dict[str, Any] = {k: _median([r[k] for r in rows]) for k in ("aggregate_samples_per_s", "vs_unscheduled",
                                                              "vs_sequential", "of_bound", "busy_fraction_mean",
                                                              "fairness", "turn_agreement", "gap_ms_p50",
                                                              "gap_ms_p90", "load1", "C_ms", "M_ms")}
        jobs = sorted({j for r in rows for j in r["jobs"]})
        med["jobs"] = {j: {"iter_s": _median([r["jobs"][j]["iter_s"] for r in rows if j in r["jobs"]]),
                           "slowdown": _median([r["jobs"][j]["slowdown"] for r in rows if j in r["jobs"]])}
                       for j in jobs}
        med["cycles"] = len(rows)
        modes[mode] = med
    for mode in MODES:
        modes[mode]["stalled_segments"] = sum(1 for s in (alone if mode == "sequential" else segs)
                                              if s["mode"] == mode and any(j["stalled"] for j in s["jobs"].values()))
    out = {"scenario": scn.name, "target_ratio": scn.ratio, "jobs": scn.jobs, "rate_mbit": raw["rate_mbit"],
           "batch": raw["batch"], "global_batch": gb, "alone_iter_ms": 1000 * t_alone, "alone_C_ms": 1000 * c_alone,
           "alone_M_ms": 1000 * m_alone, "measured_ratio": m_alone / c_alone, "bound_samples_per_s": bound,
           "policy_source_sha256": raw["policy_source_sha256"],
           "modes": modes, "segments": segs, "solo_segments": alone}
    out["targets"] = targets(out)
    return out


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if isinstance(x, (int, float)) and x == x]
    return statistics.median(vals) if vals else None


def targets(summary: dict[str, Any]) -> dict[str, bool] | None:
    """The issue's targets (1:1, two jobs), checked on the medians."""
    if summary["target_ratio"] != 1.0 or summary["jobs"] != 2:
        return None
    xo = summary["modes"]["crossover"]
    return {"crossover_vs_unscheduled_ge_1.35": xo["vs_unscheduled"] >= 1.35,
            "crossover_vs_sequential_ge_1.5": xo["vs_sequential"] >= 1.5,
            "crossover_of_bound_ge_0.85": xo["of_bound"] >= 0.85,
            "crossover_fairness_le_1.2": xo["fairness"] <= 1.2}


# ---- timeline ----------------------------------------------------------------------------------------------


def plot_timeline(raw: dict[str, Any], path: Path, title: str, seconds: float) -> None:
    """Per mode (first cycle), per node: each job's compute phases (solid) and comm phases (light)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segs = {s["mode"]: s for s in reversed(raw["segments"])}  # the first segment of each mode
    solo = raw["solos"][0]
    panels = [("sequential", solo["events"], solo["segment"])] + [(m, raw["events"], segs[m]) for m in COLOCATED
                                                                   if m in segs]
    jobs = sorted(raw["jobs"])
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 2.4 * len(panels)), squeeze=False)
    colors = [f"C{i}" for i in range(10)]  # matplotlib's default cycle
    for ax, (mode, events, seg) in zip(axes[:, 0], panels):
        lo = seg["a"]
        hi = lo + seconds
        labels, ticks, y = [], [], 0.0
        segs[mode] = seg
        for node in sorted(events):
            comp = _intervals(events[node], "grant", "release")
            comm = _intervals(events[node], "comm_begin", "comm_end")
            for k, job in enumerate(jobs):
                c = colors[k % len(colors)]
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- output ---------------------------------------------------------------------------------------------------


def render(summaries: list[dict[str, Any]], host_wait: str, nice: int) -> Table:
    t = Table(title=f"Crossover on an emulated 2-node cluster (1 core = 1 device per node, tbf links, host wait "
                    f"{host_wait}, nice {nice}); medians over cycles",
              caption="samples/s: aggregate over running jobs; ×unsched/×seq: vs the unscheduled and the one-alone "
                      "segment of the same cycle; % bound: vs Σbatch/max(ΣC,ΣM,T) with C, M, T measured alone; "
                      "slowdown: iteration vs alone; busy: union of compute phases / wall; fair: max/min slowdown; "
                      "turns agree: share of consecutive grants node1 made in node0's order; gap: release→next grant; "
                      "stalled: segments where a job finished <3 iterations; "
                      "load: 1-min load average of the shared machine")
    for c in ("scenario", "mode", "samples/s", "×unsched", "×seq", "% bound", "iter ms (slowdown) per job",
              "busy %", "fair", "turns agree", "gap p50/p90 ms", "load"):
        t.add_column(c, justify="left" if c in ("scenario", "mode") else "right")

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for s in summaries:
        head = (f"{s['scenario']}\n{s['rate_mbit']:.0f} Mbit/s, batch {s['batch']}\nalone C {s['alone_C_ms']:.0f} "
                f"M {s['alone_M_ms']:.0f} ms\nmeasured M:C {s['measured_ratio']:.2f}")
        for i, mode in enumerate(MODES):
            r = s["modes"][mode]
            per = " ".join(f"{1000 * j['iter_s']:.0f}({j['slowdown']:.2f})" for _, j in sorted(r["jobs"].items()))
            if r["stalled_segments"]:
                per += f" [{r['stalled_segments']}/{r['cycles']} stalled]"
            t.add_row(head if i == 0 else "", mode, f(r["aggregate_samples_per_s"], ".0f"),
                      f(r["vs_unscheduled"], ".2f"), f(r["vs_sequential"], ".2f"),
                      f(None if r["of_bound"] is None else 100 * r["of_bound"], ".0f") + "%", per,
                      f(None if r["busy_fraction_mean"] is None else 100 * r["busy_fraction_mean"], ".0f"),
                      f(r["fairness"], ".2f") if mode != "sequential" else "-",
                      f(None if r["turn_agreement"] is None else 100 * r["turn_agreement"], ".0f"),
                      f"{f(r['gap_ms_p50'], '.1f')}/{f(r['gap_ms_p90'], '.1f')}", f(r["load1"], ".1f"))
        t.add_row("", "bound", f"{s['bound_samples_per_s']:.0f}", "", "", "100%", "", "", "", "", "", "",
                  end_section=True)
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1:1 with two jobs only")
    p.add_argument("--scenarios", help="comma-separated subset of: " + ", ".join(s.name for s in FULL))
    p.add_argument("--cycles", type=int, default=None, help="cycles through the 4 modes (default 4, quick 3)")
    p.add_argument("--segment-s", type=float, default=None, help="measured seconds per segment (default 20 x "
                   "--iter-ms)")
    p.add_argument("--settle-s", type=float, default=1.5, help="seconds after a switch before measuring")
    p.add_argument("--warmup", type=int, default=5, help="iterations every job does before the first segment")
    p.add_argument("--solo-iters", type=int, default=25, help="iterations of each solo (alone) run")
    p.add_argument("--iter-ms", type=float, default=450.0, help="target alone iteration time (C + M)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--in-dim", type=int, default=512)
    p.add_argument("--ref-rate", type=float, default=200.0, help="first calibration link rate, Mbit/s")
    p.add_argument("--host-wait", choices=("spin", "poll"), default="poll",
                   help="poll: ranks wait for allreduces with poll + sleep, so a rank in its comm phase leaves "
                        "the emulated device free, as on a GPU; spin: stock Horovod 0.28.1, whose wait spins on "
                        "the device core")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of daemons and ranks; e.g. -10 keeps the emulated devices from being shared "
                        "with other work on the machine (slows that work down)")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--timeline-seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=Path("results/emulated.json"))
    p.add_argument("--timeline", type=Path, default=Path("results/crossover_timeline.png"))
    p.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir, removed)")
    args = p.parse_args()
    reasons = preflight()
    if reasons:
        console.print(f"[red]cannot build the emulated cluster:[/] {'; '.join(reasons)}")
        return 2
    scenarios: tuple[Scenario, ...] = QUICK if args.quick else FULL
    if args.scenarios:
        wanted = {x.strip() for x in args.scenarios.split(",")}
        scenarios = tuple(s for s in FULL if s.name in wanted)
    args.cycles = args.cycles or (3 if args.quick else 4)
    args.segment_s = args.segment_s or max(5.0, 20 * args.iter_ms / 1000)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="xo-bench-")
    workdir = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    summaries, first_raw = [], None
    total = 2 + len(scenarios) * (args.cycles * len(COLOCATED) + 2)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("calibration", total=total)

        # Two rounds: a reference point, then the predicted 1:1 point (medians; the machine is shared).
        batch, rate, rounds = 256, args.ref_rate, []
        for k in range(2):
            progress.update(task, description=f"calibration {k + 1}/2 @ {rate:g} Mbit/s, batch {batch}")
            cal = calibrate(rate, batch, args, workdir / f"calibration{k}")
            rounds.append({key: (1000 * v if key in ("C", "M") else v) for key, v in cal.items()})
            c_per_sample, m_bits = cal["C"] / batch, cal["M"] * rate  # M ~ bytes / rate
            want = args.iter_ms / 2000
            batch = max(16, int(round(want / c_per_sample / 16)) * 16)
            rate = float(round(min(2000.0, max(20.0, m_bits / want))))
            progress.advance(task)
        calibration = {"rounds_ms": rounds, "params": cal["params"], "compute_ms_per_sample": 1000 * c_per_sample,
                       "allreduce_ms_at_200mbit": 1000 * m_bits / 200}
        progress.console.print(f"calibration: {cal['params']:,} parameters; allreduce {1000 * m_bits / 200:.0f} ms "
                               f"at 200 Mbit/s; compute {1000 * c_per_sample:.3f} ms/sample")
        for scn in scenarios:
            want_c = args.iter_ms / 1000 / (1 + scn.ratio)
            want_m = args.iter_ms / 1000 * scn.ratio / (1 + scn.ratio)
            batch = max(16, int(round(want_c / c_per_sample / 16)) * 16)
            rate = float(round(min(2000.0, max(20.0, m_bits / want_m))))

            def seg_step(what: str) -> None:
                progress.update(task, description=what)
                progress.advance(task)

            raw = run_scenario(scn, rate, batch, args, workdir / scn.name.replace(":", "-").replace(" ", "_"),
                               seg_step)
            summary = summarize(scn, raw)
            summaries.append(summary)
            first_raw = first_raw or raw
            xo = summary["modes"]["crossover"]
            progress.console.print(
                f"{scn.name}: crossover {xo['aggregate_samples_per_s']:.0f} samples/s = "
                f"{xo['vs_unscheduled']:.2f}× unscheduled, {xo['vs_sequential']:.2f}× sequential, "
                f"{100 * xo['of_bound']:.0f}% of bound (medians of {args.cycles} cycles)")

    Console(width=None if sys.stdout.isatty() else 170).print(render(summaries, args.host_wait, args.nice))
    if first_raw is not None:
        s0 = summaries[0]
        plot_timeline(first_raw, args.timeline,
                      f"{s0['scenario']}: {s0['rate_mbit']:.0f} Mbit/s, batch {s0['batch']}, alone C "
                      f"{s0['alone_C_ms']:.0f} ms / M {s0['alone_M_ms']:.0f} ms, host wait {args.host_wait}, "
                      f"nice {args.nice} (first segment of each mode)", args.timeline_seconds)
        print(f"wrote {args.timeline}")
    for s in summaries:
        if s["targets"]:
            print(f"targets ({s['scenario']}): " + ", ".join(f"{k} {'MET' if v else 'MISSED'}"
                                                           for k, v in s["targets"].items()))
    write_json(args.out, {
        "benchmark": "crossover", "version": 2, "time": time.time(), "machine": machine(),
        "elapsed_s": time.monotonic() - t_start,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "setup": {"host_wait": args.host_wait, "nice": args.nice, "cycles": args.cycles, "segment_s": args.segment_s,
                  "nodes": 2,
                  "devices_per_node": 1, "ranks_per_job": 2, "workload": str(WORKLOAD.relative_to(ROOT)),
                  "unscheduled_policy": "passthrough",
                  "sequential": "solo runs of the first job (before) and the last job (after) the co-located run",
                  "note": f"4 nodes need 4 cores for 4 devices; this machine has {machine()['cpus']}, so 2 nodes"},
        "calibration": calibration,
        "scenarios": summaries,
    })
    print(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
