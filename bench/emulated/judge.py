"""Judging the emulated-cluster benchmark (`bench/emulated/`) from its raw run: per measured segment the
throughput, each job's iteration time, device-busy fraction, grant gaps and turn agreement between the
nodes (from the daemons' event logs); per scenario the ratios within each cycle, their medians over
cycles, the pipeline bound and the issue's targets."""
from __future__ import annotations

import statistics
from typing import Any

from bench.emulated.scenarios import MODES, Scenario
from bench.lib.judge import percentile
from crossover.client.cli.event_intervals import covered_length
from crossover.protos.event_file import Event, EventName, typed
from crossover.protos.event_phases import HOLDS, read_phases
from crossover.protos.event_records import CommEnd, Grant, Release


def phase_medians(events: list[Event], skip: int) -> tuple[float, float]:
    """Medians of the compute (grant to release) and comm phases in `events`, after the first `skip` of each."""
    c = [h for e in events if e.name is EventName.RELEASE and (h := Release.of(e).held_s) is not None][skip:]
    m = [CommEnd.of(e).duration_s for e in events if e.name is EventName.COMM_END][skip:]
    return statistics.median(c), statistics.median(m)


def phase_intervals(events: list[Event],
                    phases: frozenset[str] = HOLDS) -> dict[str, list[tuple[float, float]]]:
    """Per job name, the [start, end) intervals of one node's event log in `phases` (default: holding the
    device, a grant to its release), as `crossover.protos.event_phases` reads them."""
    out: dict[str, list[tuple[float, float]]] = {}
    for iv in read_phases(events).intervals:
        if iv.phase in phases:
            out.setdefault(iv.job_name, []).append((iv.start, iv.end))
    return out


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How long [lo, hi] is covered by at least one of ``intervals``."""
    return covered_length((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)


def turn_agreement(ev0: list[Event], ev1: list[Event], lo: float, hi: float) -> float | None:
    """How often two nodes granted in the same order: over consecutive grants (job, iteration) of different
    jobs on node 0 within [lo, hi], the fraction that node 1 granted in the same relative order."""
    seq0 = [(e.job, Grant.of(e).iteration) for e in typed(ev0) if e.name is EventName.GRANT and lo <= e.t <= hi]
    pos1 = {(e.job, Grant.of(e).iteration): i
            for i, e in enumerate(x for x in typed(ev1) if x.name is EventName.GRANT)}
    seq0 = [k for k in seq0 if k in pos1]
    pairs = [(a, b) for a, b in zip(seq0, seq0[1:]) if a[0] != b[0]]
    if not pairs:
        return None
    return sum(pos1[a] < pos1[b] for a, b in pairs) / len(pairs)



def analyse_segment(raw: dict[str, Any], seg: dict[str, Any]) -> dict[str, Any]:
    """One measured window [a, b] of a run: throughput and iteration time per job, busy fraction per node,
    grant gaps, turn agreement and the median compute and comm phases."""
    lo, hi = seg["a"], seg["b"]
    per_job: dict[str, dict[str, Any]] = {}
    aggregate = 0.0
    visitors = set(seg.get("visitors", ()))
    for name in seg["running"]:
        ranks = raw["visitors"][name] if name in visitors else raw["jobs"][name]
        r0 = min(ranks, key=lambda r: r["rank"])
        ends = [t for t in r0["iter_end"] if lo <= t <= hi]
        # Mean time between iteration ends; a job that (nearly) stalled gets the window over what it did.
        stalled = len(ends) < 3 and name not in visitors
        iter_s = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 3 else (hi - lo) / max(len(ends), 0.5)
        gb = sum(r["batch"] for r in ranks)
        # A visitor is there for part of the window: it adds the samples it finished in it.
        rate = len(ends) * gb / (hi - lo) if name in visitors else gb / iter_s
        per_job["visitor" if name in visitors else name] = {"iter_s": iter_s, "samples_per_s": rate,
                                                            "iters": len(ends), "stalled": stalled}
        aggregate += rate
    busy, gaps, c_held, m_comm, waits = {}, [], [], [], []
    c_by_node: dict[str, list[float]] = {}
    for node, events in raw["events"].items():
        comp = phase_intervals(events)  # a paused job may hold a passthrough grant: skip it
        busy[node] = _union_length([iv for job in seg["running"] for iv in comp.get(job, [])], lo, hi) / (hi - lo)
        last_release = None
        for e in typed(events):
            if not lo <= e.t <= hi:
                continue
            if e.name is EventName.RELEASE and (held_s := Release.of(e).held_s) is not None:
                last_release = e.t
                c_held.append(held_s)
                c_by_node.setdefault(node, []).append(held_s)
            elif e.name is EventName.GRANT:
                waits.append(Grant.of(e).waited_s)
                if last_release is not None:
                    gaps.append(e.t - last_release)
                    last_release = None
            elif e.name is EventName.COMM_END:
                m_comm.append(CommEnd.of(e).duration_s)
    # Each job's own phases on the first node (a GPU run's GPU node): where a job's slowdown comes from.
    first: list[Event] = next(iter(raw["events"].values()), [])
    for name, j in per_job.items():
        mine = [e for e in typed(first) if lo <= e.t <= hi and e.job_name == name]
        held = [h for e in mine if e.name is EventName.RELEASE and (h := Release.of(e).held_s) is not None]
        comm = [CommEnd.of(e).duration_s for e in mine if e.name is EventName.COMM_END]
        j["C_ms"] = 1000 * statistics.median(held) if held else None
        j["M_ms"] = 1000 * statistics.median(comm) if comm else None
    # Turn agreement compares two nodes that every running job is on: the scenarios with two nodes.
    logs = list(raw["events"].values())
    agreement = turn_agreement(logs[0], logs[-1], lo, hi) if len(logs) == 2 and seg["mode"] != "sequential" else None
    return {"cycle": seg["cycle"], "mode": seg["mode"], "window_s": hi - lo, "load1": seg["load1"],
            "aggregate_samples_per_s": aggregate, "jobs": per_job,
            "busy_fraction_mean": statistics.fmean(busy.values()), "busy_fraction": busy,
            "turn_agreement": agreement,
            "gap_ms_p50": 1000 * percentile(gaps, 50), "gap_ms_p90": 1000 * percentile(gaps, 90),
            "wait_ms_max": 1000 * max(waits, default=0.0),
            "C_ms": 1000 * statistics.median(c_held) if c_held else None,
            # A GPU run's node 0 holds the GPU and node 1 the stand-ins: the pooled median hides either.
            "C_ms_by_node": {n: 1000 * statistics.median(v) for n, v in c_by_node.items()},
            "M_ms": 1000 * statistics.median(m_comm) if m_comm else None}


def summarize(scn: Scenario, raw: dict[str, Any]) -> dict[str, Any]:
    """Per segment metrics; ratios within each cycle; medians over cycles; the pipeline bound."""
    segs = [analyse_segment(raw, s) for s in raw["segments"]]
    alone = [analyse_segment({**solo, "scenario": raw["scenario"]}, solo["segment"]) for solo in raw["solos"]]
    t_alone = statistics.median(j["iter_s"] for s in alone for j in s["jobs"].values())
    c_alone = statistics.median(s["C_ms"] for s in alone) / 1000
    m_alone = statistics.median(s["M_ms"] for s in alone) / 1000
    names = list(raw["jobs"])
    gbs = {n: sum(r["batch"] for r in raw["jobs"][n]) for n in names}
    gb = gbs[names[0]]
    if scn.batch_scale:  # mixed jobs: each measured alone
        t_of = {n: v["iter_s"] for s in alone for n, v in s["jobs"].items()}
        c_sum = sum(s["C_ms"] for s in alone) / 1000
        m_sum = sum(s["M_ms"] for s in alone) / 1000
    else:
        t_of = dict.fromkeys(names, t_alone)
        c_sum, m_sum = len(names) * c_alone, len(names) * m_alone
    # Round robin at best: every job once per cycle of max(sum C, sum M, the slowest job alone).
    bound = sum(gbs.values()) / max(c_sum, m_sum, max(t_of.values()))
    # One after another, the same number of iterations each.
    seq_aggregate = sum(gbs.values()) / sum(t_of.values())
    cycles: dict[int, dict[str, dict[str, Any]]] = {}
    for s in segs:
        cycles.setdefault(s["cycle"], {})[s["mode"]] = s
    for cyc in cycles.values():
        seq = {**alone[0], "cycle": next(iter(cyc.values()))["cycle"], "aggregate_samples_per_s": seq_aggregate,
               "jobs": {j: v for a_ in alone for j, v in a_["jobs"].items()}}
        cyc["sequential"] = seq
        for s in cyc.values():
            for name, j in s["jobs"].items():
                j["slowdown"] = j["iter_s"] / t_of.get(name, t_alone)
            slow = [j["slowdown"] for j in s["jobs"].values()]
            s["fairness"] = max(slow) / min(slow)
            # Each job's speed relative to alone, summed; the sequential mode runs one job at a time: 1.
            s["progress"] = 1.0 if s is seq else sum(1 / x for x in slow)
            s["vs_unscheduled"] = s["aggregate_samples_per_s"] / cyc["unscheduled"]["aggregate_samples_per_s"]
            s["vs_sequential"] = s["aggregate_samples_per_s"] / seq_aggregate
            s["of_bound"] = s["aggregate_samples_per_s"] / bound
        for s in cyc.values():
            s["progress_vs_unscheduled"] = s["progress"] / cyc["unscheduled"]["progress"]
    modes = {}
    measured = [m for m in MODES if m == "sequential" or any(s["mode"] == m for s in segs)]
    for mode in measured:
        rows = [c[mode] for c in cycles.values() if mode in c]
        med: dict[str, Any] = {k: _median([r[k] for r in rows]) for k in ("aggregate_samples_per_s", "vs_unscheduled",
                                                              "vs_sequential", "of_bound", "busy_fraction_mean",
                                                              "fairness", "turn_agreement", "gap_ms_p50",
                                                              "gap_ms_p90", "wait_ms_max", "load1", "C_ms",
                                                              "M_ms", "progress", "progress_vs_unscheduled")}
        jobs = sorted({j for r in rows for j in r["jobs"]})
        med["jobs"] = {j: {"iter_s": _median([r["jobs"][j]["iter_s"] for r in rows if j in r["jobs"]]),
                           "slowdown": _median([r["jobs"][j]["slowdown"] for r in rows if j in r["jobs"]]),
                           **{k: _median([r["jobs"][j].get(k) for r in rows if j in r["jobs"]])
                              for k in ("C_ms", "M_ms")}}
                       for j in jobs}
        nodes = sorted({n for r in rows for n in r.get("C_ms_by_node", {})})
        med["C_ms_by_node"] = {n: _median([r["C_ms_by_node"][n] for r in rows if n in r.get("C_ms_by_node", {})])
                               for n in nodes}
        med["wait_ms_worst"] = max((r["wait_ms_max"] for r in rows), default=None)
        med["vs_unscheduled_spread"] = spread([r["vs_unscheduled"] for r in rows])
        med["samples_spread"] = spread([r["aggregate_samples_per_s"] for r in rows])  # the mode's own steadiness
        med["cycles"] = len(rows)
        modes[mode] = med
    for mode in measured:
        modes[mode]["stalled_segments"] = sum(1 for s in (alone if mode == "sequential" else segs)
                                              if s["mode"] == mode and any(j["stalled"] for j in s["jobs"].values()))
    out = {"scenario": scn.name, "target_ratio": scn.ratio, "jobs": scn.jobs, "rate_mbit": raw["rate_mbit"],
           "nodes": scn.nodes, "placement": [list(p) for p in scn.placement], "visitor": scn.visitor,
           "batch_scale": list(scn.batch_scale), "job_batches": gbs,
           "batch": raw["batch"], "global_batch": gb, "alone_iter_ms": 1000 * t_alone, "alone_C_ms": 1000 * c_alone,
           "alone_M_ms": 1000 * m_alone, "measured_ratio": m_alone / c_alone, "bound_samples_per_s": bound,
           "policy_source_sha256": raw["policy_source_sha256"],
           "modes": modes, "segments": segs, "solo_segments": alone}
    out["targets"] = targets(out)
    return out


def spread(xs: list[float]) -> float | None:
    """How far the farthest cycle's ratio lies from their median, as a fraction of it (0.03: within ±3 %)."""
    med = _median(xs)
    if not med:
        return None
    return max(abs(x / med - 1.0) for x in xs if isinstance(x, (int, float)) and x == x)


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if isinstance(x, (int, float)) and x == x]
    return statistics.median(vals) if vals else None


def targets(summary: dict[str, Any]) -> dict[str, bool] | None:
    """The issue's targets (1:1, two jobs on the same nodes), checked on the medians."""
    if summary["target_ratio"] != 1.0 or summary["jobs"] != 2 or summary["placement"] or summary["visitor"]:
        return None
    xo = summary["modes"]["crossover"]
    return {"crossover_vs_unscheduled_ge_1.35": xo["vs_unscheduled"] >= 1.35,
            "crossover_vs_sequential_ge_1.5": xo["vs_sequential"] >= 1.5,
            "crossover_of_bound_ge_0.85": xo["of_bound"] >= 0.85,
            "crossover_fairness_le_1.2": xo["fairness"] <= 1.2}

