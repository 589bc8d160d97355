"""Can a second job use a device without slowing the one that matters? Priority classes measured side by side.

One production job (`normal`, the default class) shares its devices with one or two
opportunistic jobs that said `CROSSOVER_PRIORITY=low`. Every job's speed is given
relative to its speed alone (1.0: as if alone), in four modes measured in one run:

  unscheduled  no grants (time-slicing: what a GPU does without us)
  equal        the default policy, every job in one class
  classes-open the opportunistic jobs in class `low`, the class rules alone
               (`crossover policy --protect 0`: no isolation controller)
  classes      the same with the daemon as it ships: the isolation controller
               holds the production job at --protect 0.97 of its pace alone
  classes-dscp (model/core, asked with --modes) `classes` on links that send the
               low jobs' traffic last: they mark it DSCP CS1 (CROSSOVER_LOW_DSCP),
               as a network that honours DSCP would
  classes-adaptive (model/core, asked with --modes) `classes` with the daemons as
               they ship (--adapt): each device probes grants against none and keeps
               grants only where they pay the production job; measured after the
               first verdict, whose mode each segment records

Beds:

  --bed sim    the simulator (`testbed.simulator`, the daemon's own policy classes):
               two nodes x one device, 1:1 and comm-bound (1:2), with one and two
               low jobs, at the device model's interference (0.19) and without it;
               a node without gaps (jobs that barely communicate); and 64 nodes x 8
               devices with churn (the low jobs come and go). Seconds.
  --bed model  the emulated cluster with the device model (`testbed.device_model`):
               real Horovod jobs, real daemons; two nodes; the low job's class is
               switched on both daemons (`crossover priority`'s call) per segment,
               interleaved over --cycles. Minutes.
  --bed core   the same with each node's device a CPU core.

The simulator models the plugin's yield at a gradient as a fixed delay (`--yield-ms`,
5 ms: a layer's backward and the message; 0: not modelled, a low holder keeps the device
to its phase's end, as the simulator did before 2026-11-29, and the policy learns within a
few asks that the job does not yield). The device model's compute phase is one piece,
so a yield waits for its end there, unless --device-in-backward runs it layer by layer in
the backward, as a GPU whose queue the plugin bounds does (docs/priorities.md, rule 3).

    python -m bench.priority --bed sim [--out results/priority_sim.json]
    python -m bench.priority --bed sim --frontier   # what any fixed budget gives, beside the controller
    python -m bench.priority --bed model --cycles 3 [--out results/priority_model.json]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.judge import percentile
from bench.lib.results import machine, write_json
from crossover.daemon.policies import CrossoverPolicy
from crossover.daemon.policies.classes import ClassSettings
from crossover.daemon.policies.isolation import IsolationSettings
from crossover.protos.event_records import Isolation
from testbed.simulator import JobSpec, SimConfig, simulate

MODES = ("unscheduled", "equal", "classes-open", "classes")
EMULATED_MODES = (*MODES, "classes-dscp", "classes-adaptive")
"""The emulated beds' modes: `classes` is the daemons' policy as it ships (the isolation controller holding the
production job at `--protect` 0.97); `classes-open`, the class rules without it (`crossover policy --protect 0`);
`classes-dscp`: `classes` with the links sending the low jobs' DSCP-marked packets last; `classes-adaptive`:
`classes` where each device keeps grants only if they pay the production job (`--adapt`)."""
_ADAPT_WINDOW_S = 3.0  # the emulated beds' daemons' --adapt-window: ten iterations of 300 ms
SIM_MODES = MODES
"""The simulator's modes, as the emulated beds': `classes-open` is the daemon with `--protect 0`."""
SIM_JITTER = 0.05
"""The simulator's lognormal sigma on every phase (`--jitter`)."""
SIM_YIELD_S: float | None = 0.005
"""How long after the policy asks a simulated rank hands its device back (`--yield-ms`; None: never)."""


RULES = {
    "as shipped": ClassSettings(),
    "guard 0.05 (the old default)": ClassSettings(guard_share=0.05),
    "no guard": ClassSettings(guard_share=0.0),
    "no gap fitting": ClassSettings(fit_margin=math.inf),
    "no cut turns": ClassSettings(cut_turns=False),
}
"""`--rules`: the open-loop class rules each taken out (or set as before) under the isolation controller."""


def _sim_policy(mode: str, classes: ClassSettings | None = None) -> Any:
    """The policy (a name, or a factory) the simulator runs for `mode`; `classes`: mode `classes`'s settings."""
    if mode == "classes" and classes is not None:
        return lambda: CrossoverPolicy(classes=classes)
    if mode == "classes-open":
        return lambda: CrossoverPolicy(classes=ClassSettings(isolation=IsolationSettings(target=0.0)))
    return {"unscheduled": "passthrough", "equal": "crossover", "classes": "crossover"}[mode]


def low_ceiling(device_s: float, iter_s: float, lows: int = 1, interference: float = 0.0,
                low_iter_s: float | None = None) -> float:
    """The most each of `lows` low jobs can get (speed relative to alone) beside a production job kept
    whole: the device time the production job leaves free in one of its iterations, shared by the low jobs,
    over the device time a low job needs per iteration of its own, which runs slower by `interference`
    beside the production job's allreduce. `device_s`: one iteration's device work (the same for every
    job); `iter_s`: the production job's iteration alone; `low_iter_s`: a low job's (None: the same, as for
    identical jobs). A target above it cannot be met by any schedule."""
    low_iter_s = iter_s if low_iter_s is None else low_iter_s
    if not 0.0 < device_s <= min(iter_s, low_iter_s):
        return 0.0
    free = 1.0 - device_s / iter_s
    return free / (device_s / low_iter_s) / lows / (1.0 + interference)


# ---- the simulator ---------------------------------------------------------------------------------------


def _sim_jobs(compute_s: float, comm_s: float, lows: int, classes: bool,
              place: tuple[tuple[int, int], ...] = ((0, 0), (1, 0)), jitter: float = SIM_JITTER) -> list[JobSpec]:
    """Every job runs until the horizon, so each one's rate is measured over the same stretch."""
    jobs = [JobSpec("prod", place, compute_s, comm_s, jitter=jitter)]
    jobs += [JobSpec(f"opp{i}", place, compute_s, comm_s, jitter=jitter, priority="low" if classes else "normal")
             for i in range(lows)]
    return jobs


def sim_point(compute_s: float, comm_s: float, lows: int, interference: float, iterations: int = 300,
              seed: int = 0, modes: tuple[str, ...] = SIM_MODES, classes: ClassSettings | None = None,
              jitter: float = SIM_JITTER, yield_s: float | None = SIM_YIELD_S) -> dict[str, Any]:
    """One scenario in every mode: each job's speed relative to alone (prod's run ends the measurement)."""
    cfg = SimConfig(seed=seed, switch_penalty=0.04, tick_s=0.1, grant_latency_s=0.0003, link_sharing="fifo",
                    interference=interference, comm_interference=0.0, startup_spread_s=0.2,
                    horizon_s=iterations * (compute_s + comm_s), yield_s=yield_s)
    out: dict[str, Any] = {"compute_s": compute_s, "comm_s": comm_s, "lows": lows, "interference": interference}
    for mode in modes:
        res = simulate(_sim_jobs(compute_s, comm_s, lows, mode.startswith("classes"), jitter=jitter),
                       _sim_policy(mode, classes),
                       n_nodes=2,
                       config=cfg)
        out[mode] = {"speed_vs_alone": {j.name: (1.0 / j.slowdown if j.slowdown else 0.0) for j in res.jobs}}
    return out


def sim_fleet(mode: str, seed: int = 0, horizon_s: float = 120.0, classes: ClassSettings | None = None,
              jitter: float = SIM_JITTER, yield_s: float | None = SIM_YIELD_S) -> dict[str, Any]:
    """64 nodes x 8 devices: on each device one production job (ranks over 4 nodes) and churning low jobs."""
    import random

    lows_low = mode.startswith("classes")
    rng = random.Random(seed)
    jobs: list[JobSpec] = []
    for group in range(16):  # 16 groups of 4 nodes
        nodes = range(4 * group, 4 * group + 4)
        for dev in range(8):
            place = tuple((n, dev) for n in nodes)
            c = rng.uniform(0.08, 0.15)
            jobs.append(JobSpec(f"prod-{group}-{dev}", place, c, c * rng.uniform(0.8, 1.2), jitter=jitter))
            t = rng.uniform(0, 20)
            while t < horizon_s:  # opportunistic jobs arrive, run a while, leave
                stay = rng.uniform(15, 40)
                c2 = rng.uniform(0.05, 0.15)
                jobs.append(JobSpec(f"opp-{group}-{dev}-{int(t)}", place, c2, c2 * rng.uniform(0.8, 1.5),
                                    arrival_s=t, leave_s=min(horizon_s, t + stay), jitter=jitter,
                                    priority="low" if lows_low else "normal"))
                t += stay + rng.uniform(2, 10)
    cfg = SimConfig(seed=seed, switch_penalty=0.04, tick_s=0.1, grant_latency_s=0.0003, link_sharing="fifo",
                    interference=0.19, comm_interference=0.0, horizon_s=horizon_s, yield_s=yield_s)
    res = simulate(jobs, _sim_policy(mode, classes), n_nodes=64, devices_per_node=8, config=cfg)
    prod = [1.0 / j.slowdown for j in res.jobs if j.name.startswith("prod") and j.slowdown]
    opp = [1.0 / j.slowdown for j in res.jobs if j.name.startswith("opp") and j.slowdown]
    return {"prod_speed_median": statistics.median(prod), "prod_speed_p10": percentile(prod, 10),
            "opp_speed_median": statistics.median(opp) if opp else None, "jobs": len(res.jobs)}


_RULE_POINTS = (("1:1", 1.0, 0.0), ("1:1", 1.0, 0.19), ("comm-bound 2:1", 2.0, 0.19), ("no gaps", 0.05, 0.19))


def _beside_one_low(args: argparse.Namespace, ratio: float, interference: float,
                    classes: ClassSettings | None) -> dict[str, float]:
    """Mode `classes` with `classes` (None: as shipped) on two nodes beside one low job: each job's speed."""
    pt = sim_point(0.1, 0.1 * ratio, 1, interference, iterations=args.iters, modes=("classes",), classes=classes,
                   jitter=args.jitter, yield_s=args.yield_s)
    return pt["classes"]["speed_vs_alone"]  # type: ignore[no-any-return]


def _fleet(args: argparse.Namespace, mode: str = "classes", classes: ClassSettings | None = None) -> dict[str, Any]:
    """`sim_fleet` at the run's horizon, jitter and yield."""
    return sim_fleet(mode, horizon_s=args.fleet_horizon, classes=classes, jitter=args.jitter, yield_s=args.yield_s)


def run_rules(args: argparse.Namespace) -> dict[str, Any]:
    """Mode `classes` (the controller on) with each variant of `RULES`: two nodes beside one low job, and the
    fleet."""
    return {name: {"points": {f"{scenario}, interference {interference:g}": _beside_one_low(args, ratio, interference,
                                                                                          classes)
                              for scenario, ratio, interference in _RULE_POINTS},
                   "fleet_64x8": _fleet(args, classes=classes)}
            for name, classes in RULES.items()}


def _rules_table(result: dict[str, Any]) -> Table:
    t = Table(title="speed relative to alone under the isolation controller, simulator: prod / low",
              title_justify="left")
    names = list(next(iter(result.values()))["points"])
    for col in ("rules", *names, "fleet prod median / p10 / low"):
        t.add_column(col, justify="left" if col == "rules" else "right")
    for rules, r in result.items():
        f = r["fleet_64x8"]
        t.add_row(rules, *(f"{r['points'][n]['prod']:.3f} / {r['points'][n]['opp0']:.3f}" for n in names),
                  f"{f['prod_speed_median']:.3f} / {f['prod_speed_p10']:.3f} / {f['opp_speed_median']:.3f}")
    return t


FLEET_P10_TARGET = 0.93
"""The issue's floor for the fleet's production jobs: their 10th percentile of speed relative to alone."""
FRONTIER_BUDGETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0)
"""`--frontier`'s pinned budgets (device seconds per second the low class may hold)."""
_FRONTIER_POINTS = (("1:1", 1.0, 0.0), ("1:1", 1.0, 0.19), ("comm-bound 2:1", 2.0, 0.0), ("comm-bound 2:1", 2.0, 0.19))


def pinned(budget: float) -> ClassSettings:
    """The class rules with the lower classes' budget held at `budget`: the controller still measures (its solo
    windows, budget 0, come as they do) but never moves it (a target it always meets, a ceiling at the start)."""
    return ClassSettings(isolation=IsolationSettings(target=1e-3, initial=budget, ceiling=budget))


def best_within(points: list[tuple[float, float]], target: float) -> float | None:
    """The most a low job gets while the production job keeps `target`, along a frontier of (production, low)
    speeds measured at rising budgets: the low speed where the production speed crosses the target, interpolated
    between the two budgets around the crossing; the last point's, if it never does; None if no point keeps the
    target."""
    kept = [low for prod, low in points if prod >= target]
    crossings = [l0 + (l1 - l0) * (p0 - target) / (p0 - p1)
                 for (p0, l0), (p1, l1) in zip(points, points[1:]) if p0 >= target > p1]
    return max(kept + crossings, default=None)


def run_frontier(args: argparse.Namespace) -> dict[str, Any]:
    """Two nodes beside one low job: the class rules at each of `FRONTIER_BUDGETS` held fixed, and the controller
    (mode `classes`), in each scenario of `_FRONTIER_POINTS`; and the fleet likewise (its production jobs' median
    against the target, where their 10th percentile keeps `FLEET_P10_TARGET`). The budgets' frontier says what a
    budget can give the low job at all while the production job keeps its target, which a device-time bound
    (`low_ceiling`) does not: the link the jobs share and the interference of a low phase with an allreduce cost
    the production job whatever the device time left free."""
    target = IsolationSettings.target
    out: dict[str, Any] = {}
    for scenario, ratio, interference in _FRONTIER_POINTS:
        budgets = {b: _beside_one_low(args, ratio, interference, pinned(b)) for b in FRONTIER_BUDGETS}
        controller = _beside_one_low(args, ratio, interference, None)
        best = best_within([(r["prod"], r["opp0"]) for r in budgets.values()], target)
        out[f"{scenario}, interference {interference:g}"] = {
            "budgets": {f"{b:g}": r for b, r in budgets.items()}, "controller": controller,
            "best_within_target": best, "controller_share_of_best": controller["opp0"] / best if best else None,
            "low_ceiling": low_ceiling(0.1, 0.1 * (1 + ratio), 1, interference)}
        print(f"{scenario}, interference {interference:g}: best within {target:g} {best}, controller {controller}",
              flush=True)
    fleet = {f"{b:g}": _fleet(args, classes=pinned(b)) for b in FRONTIER_BUDGETS}
    shipped = _fleet(args)
    kept = [(f["prod_speed_median"], f["opp_speed_median"]) for f in fleet.values()
            if f["prod_speed_p10"] >= FLEET_P10_TARGET]
    best = best_within(kept, target)
    out[f"fleet 64x8, median (p10 >= {FLEET_P10_TARGET:g})"] = {
        "budgets": fleet, "controller": shipped, "best_within_target": best,
        "controller_share_of_best": shipped["opp_speed_median"] / best if best else None}
    print(f"fleet: best within {target:g} {best}, controller {shipped}", flush=True)
    return out


def _frontier_table(result: dict[str, Any]) -> Table:
    t = Table(title=f"prod / low at a pinned low-class budget (s/s) and under the controller, simulator, "
                    f"target {IsolationSettings.target:g}", title_justify="left")
    for col in ("scenario", *(f"{b:g}" for b in FRONTIER_BUDGETS), "controller", "best within target",
                "low_ceiling"):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    def cell(x: dict[str, Any]) -> str:
        if "prod" in x:
            return f"{x['prod']:.3f} / {x['opp0']:.3f}"
        return f"{x['prod_speed_median']:.3f} ({x['prod_speed_p10']:.3f}) / {x['opp_speed_median']:.3f}"

    for name, r in result.items():
        best = r["best_within_target"]
        t.add_row(name, *(cell(x) for x in r["budgets"].values()), cell(r["controller"]),
                  "none" if best is None else f"{best:.3f}",
                  f"{r['low_ceiling']:.2f}" if "low_ceiling" in r else "")
    return t


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    points = []
    for interference in (0.0, 0.19):
        for ratio, name in ((1.0, "1:1"), (2.0, "comm-bound 2:1")):
            for lows in (1, 2):
                pt = sim_point(0.1, 0.1 * ratio, lows, interference, iterations=args.iters, jitter=args.jitter,
                               yield_s=args.yield_s)
                pt["scenario"] = f"{name}, 1 prod + {lows} low"
                points.append(pt)
    gapless = sim_point(0.1, 0.005, 1, 0.19, iterations=args.iters, jitter=args.jitter, yield_s=args.yield_s)
    gapless["scenario"] = "no gaps (comm 0.05x compute), 1 prod + 1 low"
    points.append(gapless)
    return {"points": points, "fleet_64x8": {m: _fleet(args, m)
                                        for m in SIM_MODES}}


def _sim_table(result: dict[str, Any]) -> Table:
    t = Table(title="speed relative to alone, simulator (2 nodes x 1 device)", title_justify="left")
    for col in ("scenario", "interf.", *(f"{m} prod / low" for m in SIM_MODES)):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    for pt in result["points"]:
        cells = []
        for mode in SIM_MODES:
            sp = pt[mode]["speed_vs_alone"]
            lows = [v for k, v in sp.items() if k != "prod"]
            cells.append(f"{sp['prod']:.2f} / " + ",".join(f"{v:.2f}" for v in lows))
        t.add_row(pt["scenario"], f"{pt['interference']:g}", *cells)
    return t


# ---- the emulated cluster ----------------------------------------------------------------------------


def run_emulated(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Two nodes, one production job and `--lows` low jobs; modes interleaved per cycle; solo runs for 'alone'."""
    from bench.emulated.cli import ClusterAdmin, _job_cmd, _script, calibrate, job_ids, parser, run_solo, wait_warm
    from bench.emulated.scenarios import ADAPTS, CLASSES, DSCP, OPEN_LOOP, settle_s
    from crossover.protos.event_file import EventName, read_events
    from crossover.protos.event_records import Sharing
    from testbed.cluster import Cluster, ClusterSpec, Link
    from testbed.device_model import DeviceParams
    from testbed.harness.jobs import rank_summaries

    args.device_params = DeviceParams(interference=args.interference) if args.bed == "model" else None
    args.job_env = {"CROSSOVER_REPORT_INTERVAL": "0"}
    args.device_cores = ()
    args.width, args.in_dim = 512, 512
    args.adapt_window = _ADAPT_WINDOW_S
    args.host_wait, args.nice = "poll", 0
    for name, default in vars(parser().parse_args([])).items():  # every other option of the bed, as it defaults
        if not hasattr(args, name):
            setattr(args, name, default)
    want_c = args.iter_ms / 1000 / (1 + args.ratio)
    # The link is set with the device work in one piece: in the backward each gradient's allreduce overlaps
    # the layers still to compute, so the allreduce measured after the compute would read short and set a link
    # too slow for 1:1 (comm-bound jobs, which priorities on the device cannot help).
    cal = calibrate(200.0, 256, argparse.Namespace(**{**vars(args), "device_in_backward": False}),
                    workdir / "calibration")
    per_sample = cal["C"] / 256
    batch = max(16, int(round(want_c / per_sample / 16)) * 16)
    rate = float(round(min(2000.0, max(20.0, cal["M"] * 200.0 / (want_c * args.ratio)))))
    names = ["prod", *(f"opp{i}" for i in range(args.lows))]
    low_nodes = None if args.low_nodes >= 2 else list(range(args.low_nodes))  # None: a rank on every node
    alone = {}
    for k, name in enumerate(names[:2]):  # prod alone, and one low job alone (the others are alike)
        solo = run_solo(name, 1000 + k, rate, batch, args, workdir / f"solo_{name}", nodes=low_nodes if k else None)
        r0 = min(solo["jobs"][name], key=lambda r: r["rank"])
        its = list(zip(r0["iter_start"], r0["iter_end"]))[args.warmup:]
        alone[name] = (its[-1][1] - its[0][0]) / max(1, len(its))
    if low_nodes is None:  # identical jobs: one figure alone for both, the median
        alone = dict.fromkeys(alone, statistics.median(alone.values()))
    alone_of = {n: alone["prod" if n == "prod" else "opp0"] for n in names}
    spec = ClusterSpec(nodes=2, link=Link(rate_mbit=rate), policy="passthrough", device_model=args.device_params,
                       daemon_args=("--adapt-window", f"{_ADAPT_WINDOW_S:g}"))
    stop = workdir / "stop"
    stop.unlink(missing_ok=True)  # a kept --workdir's last run left its jobs' stop file there
    script = _script(workdir, "poll")
    segments: list[dict[str, Any]] = []
    with Cluster(spec, workdir=workdir / "cluster") as cluster:
        jobs = [cluster.run(_job_cmd(script, args, batch, workdir / f"out_{n}", 1000 + k, stop=stop), name=n,
                            env=args.job_env, nodes=low_nodes if k else None) for k, n in enumerate(names)]
        admin = ClusterAdmin(cluster)
        try:
            wait_warm(cluster, jobs, names, args.warmup)
            ids = job_ids(cluster)
            modes = tuple(m for m in EMULATED_MODES if m in args.modes.split(","))
            for cycle in range(args.cycles):
                order = modes[cycle % len(modes):] + modes[:cycle % len(modes)]
                for mode in order:
                    admin.set_policy("passthrough" if mode == "unscheduled" else "crossover", adapt=mode in ADAPTS,
                                     protect=0.0 if mode in OPEN_LOOP else IsolationSettings.target)
                    admin.set_class([ids[n] for n in names[1:]], low=mode in CLASSES, nodes=low_nodes)
                    cluster.honour_dscp(mode in DSCP)
                    time.sleep(settle_s(mode, args.settle_s, _ADAPT_WINDOW_S))
                    a = time.monotonic()
                    time.sleep(args.segment_s)
                    segments.append({"cycle": cycle, "mode": mode, "a": a, "b": time.monotonic()})
                    for j in jobs:
                        if j.poll() is not None:
                            raise RuntimeError(f"{j.name} exited during the run:\n{j.output()[-3000:]}")
        finally:
            admin.close()
            stop.touch()
        for j in jobs:
            if j.wait(300) != 0:
                raise RuntimeError(f"{j.name} failed:\n{j.output()[-3000:]}")
        logs = {node.name: read_events(node.event_log) for node in cluster.nodes}
        verdicts = [(e.t, name, Sharing.of(e)) for name, events in logs.items() for e in events
                    if e.name is EventName.SHARING]
        sharing = sorted(((t, name, v.mode, v.reason) for t, name, v in verdicts), key=lambda x: x[0])
        isolation = [(e.t, name, Isolation.of(e)) for name, events in logs.items() for e in events
                     if e.name is EventName.ISOLATION]
    for seg in segments:
        if seg["mode"] in ADAPTS:  # each node's verdict in force while the segment was measured
            seg["sharing"] = {node: [mode, reason] for t, node, mode, reason in sharing if t <= seg["a"]}
        seg["controller"] = _controller_view(isolation, seg["a"], seg["b"])
    summaries = {n: rank_summaries(workdir / f"out_{n}") for n in names}
    rows: list[dict[str, Any]] = []
    for seg in segments:
        speeds: dict[str, float] = {}
        for n in names:
            r0 = min(summaries[n], key=lambda r: r["rank"])
            ends = [e for e in r0["iter_end"] if seg["a"] <= e <= seg["b"]]  # a starved job may end one, or none
            speeds[n] = alone_of[n] * len(ends) / (seg["b"] - seg["a"])
        rows.append({**seg, "speed_vs_alone": speeds})
    med = {m: {n: statistics.median(r["speed_vs_alone"][n] for r in rows if r["mode"] == m) for n in names}
           for m in EMULATED_MODES if any(r["mode"] == m for r in rows)}
    device_s = per_sample * batch
    ceiling = low_ceiling(device_s, alone["prod"], args.lows, args.interference if args.bed == "model" else 0.0,
                          low_iter_s=alone["opp0"])
    return {"rate_mbit": rate, "batch": batch, "alone_iter_s": alone, "segments": rows, "medians": med,
            "calibration_ms": {"C": 1000 * cal["C"], "M": 1000 * cal["M"]},
            "device_busy_alone": device_s / alone["prod"], "low_ceiling": ceiling,
            "low_share_of_ceiling": {m: {n: v / ceiling if ceiling else 0.0 for n, v in by_job.items() if n != "prod"}
                                     for m, by_job in med.items()}}


def _controller_view(isolation: list[tuple[float, str, Isolation]], a: float, b: float) -> dict[str, Any]:
    """What each node's isolation controller saw in [a, b]: the production job's speed in its shared windows
    against its reference (its solo windows, with the low jobs present but not computing), the median over
    the windows whose judgement changed the budget (only those write an `isolation` event, so a budget held
    at its ceiling is missing), each window's own reading (the judgement pools two), and the median budget.
    Against the bed's own figure (alone on a cluster of its own), the difference is what the low jobs' mere
    presence costs, which no grant controls."""
    out: dict[str, Any] = {}
    for node in sorted({n for _, n, _ in isolation}):
        seen = [e for t, n, e in isolation if n == node and a <= t <= b]
        kept = [e.reference_s / e.current_s for e in seen if e.window == "shared" and e.reference_s and e.current_s]
        budgets = [e.budget for e in seen if e.window == "shared"]
        out[node] = {"kept_vs_solo_windows": statistics.median(kept) if kept else None,
                     "budget": statistics.median(budgets) if budgets else None, "windows": len(kept)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bed", choices=("sim", "model", "core"), default="sim")
    p.add_argument("--iters", type=int, default=300, help="sim: production iterations per run")
    p.add_argument("--fleet-horizon", type=float, default=120.0, help="sim: seconds simulated on 64 x 8")
    p.add_argument("--jitter", type=float, default=SIM_JITTER,
                   help="sim: sigma of the lognormal factor (mean 1) on every compute and allreduce "
                        "(a noisier machine: 0.15)")
    p.add_argument("--yield-ms", type=float, default=1e3 * (SIM_YIELD_S or 0.0),
                   help="sim: how long after the policy asks a rank hands its device back (a layer's backward and "
                        "the message; 0: never, the phase runs to its end)")
    p.add_argument("--rules", action="store_true",
                   help="sim: the controller with each open-loop class rule taken out or set as before (guard, "
                        "gap fitting), instead of the modes")
    p.add_argument("--frontier", action="store_true",
                   help="sim: the class rules at each of a row of pinned low-class budgets beside the controller, "
                        "and the most any of them gives the low job while the production job keeps its target")
    p.add_argument("--lows", type=int, default=1, help="model/core: low jobs beside the production job")
    p.add_argument("--low-nodes", type=int, default=2, choices=(1, 2),
                   help="model/core: the nodes each low job runs on (1: a one-rank low job on node 0 only, "
                        "beside one of the production job's two ranks)")
    p.add_argument("--ratio", type=float, default=1.0, help="model/core: comm:compute of a job alone")
    p.add_argument("--interference", type=float, default=0.19, help="model: compute slowdown beside an allreduce")
    p.add_argument("--iter-ms", type=float, default=300.0)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--segment-s", type=float, default=10.0)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--solo-iters", type=int, default=25)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--device-ms-per-sample", type=float, default=1.0)
    p.add_argument("--depth", type=int, default=2,
                   help="model/core: hidden layers of each job's MLP; with --device-in-backward a yield point "
                        "falls between two of its 2 x (depth + 1) parameters")
    p.add_argument("--device-in-backward", action="store_true",
                   help="model: each rank's device work runs layer by layer in its backward, so a low holder's "
                        "yield at a gradient hands the device over within a layer (a GPU with a bounded queue)")
    p.add_argument("--out", type=Path)
    p.add_argument("--workdir", type=Path, help="model/core: keep the run's logs and event logs here")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"model/core: the modes to cycle through, of {', '.join(EMULATED_MODES)}")
    args = p.parse_args(argv)
    if args.yield_ms < 0:
        p.error(f"--yield-ms {args.yield_ms:g}: must be >= 0 (0: a rank never yields)")
    args.yield_s = args.yield_ms / 1e3 or None
    t0 = time.monotonic()
    if args.rules and args.frontier:
        p.error("--rules and --frontier are two runs: ask for one")
    if args.bed != "sim" and (args.rules or args.frontier):
        p.error("--rules and --frontier run on --bed sim")
    if args.bed == "sim" and args.frontier:
        result = {"frontier": run_frontier(args)}
        Console(width=None if sys.stdout.isatty() else 260).print(_frontier_table(result["frontier"]))
    elif args.bed == "sim" and args.rules:
        result = {"rules": run_rules(args)}
        Console(width=None if sys.stdout.isatty() else 200).print(_rules_table(result["rules"]))
    elif args.bed == "sim":
        result = run_sim(args)
        Console(width=None if sys.stdout.isatty() else 160).print(_sim_table(result))
        for mode, r in result["fleet_64x8"].items():
            print(f"64 x 8 with churn, {mode}: {r}")
    else:
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            result = run_emulated(args, args.workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="xo-priority-") as tmp:
                result = run_emulated(args, Path(tmp))
        print(f"{args.bed} bed, 1 prod + {args.lows} low, comm:compute {args.ratio:g}: medians of speed vs alone "
              f"over {args.cycles} cycles: {result['medians']}; the most a low job could get with the production "
              f"job whole: {result['low_ceiling']:.2f}")
    kind = "_rules" if args.rules else "_frontier" if args.frontier else ""
    out = args.out or Path(f"results/priority_{args.bed}{kind}.json")
    write_json(out, {"benchmark": "priority", "bed": args.bed, "time": time.time(), "machine": machine(),
                     "elapsed_s": time.monotonic() - t0,
                     "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                              if k not in ("device_params",)}, **result})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
