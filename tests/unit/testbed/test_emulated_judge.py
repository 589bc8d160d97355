"""bench.emulated.judge on a hand-made segment: compute phases per node as well as pooled."""
from __future__ import annotations

import pytest

from bench.emulated.judge import analyse_segment
from crossover.protos.event_records import CommEnd, Grant, RankTag, Record, Release


def _line(t: float, tag: RankTag, record: Record) -> dict:
    return {"event": str(record.name), "t": t, **tag.fields(), **record.fields()}


def _phases(node_held_s: float, t0: float) -> list[dict]:
    tag = RankTag(job="a", job_name="a", rank=0, device=0, node="n")
    events = []
    for i in range(3):
        t = t0 + 0.2 * i
        events.append(_line(t, tag, Grant(iteration=i, waited_s=0.0)))
        events.append(_line(t + node_held_s, tag, Release(held_s=node_held_s)))
    return events


def test_a_segment_gives_each_nodes_compute_phase_beside_the_pooled_one() -> None:
    raw = {"jobs": {"a": [{"rank": 0, "iter_end": [1.2, 1.4, 1.6, 1.8], "batch": 8},
                          {"rank": 1, "iter_end": [1.2, 1.4, 1.6, 1.8], "batch": 8}]},
           "visitors": {}, "events": {"node0": _phases(0.090, 1.0), "node1": _phases(0.088, 1.0)}}
    seg = {"a": 0.9, "b": 2.0, "running": ["a"], "cycle": 0, "mode": "exclusive", "load1": 0.0}
    out = analyse_segment(raw, seg)
    assert out["C_ms_by_node"] == pytest.approx({"node0": 90.0, "node1": 88.0})
    assert out["C_ms"] == pytest.approx(89.0)  # the median of both nodes' six phases
    assert out["aggregate_samples_per_s"] == pytest.approx(16 / 0.2)


def test_each_job_gets_its_own_phases_on_the_first_node() -> None:
    def job(name: str, held_s: float, comm_s: float) -> list[dict]:
        out = []
        for i in range(3):
            t = 1.0 + 0.3 * i
            tag = RankTag(job=f"id-{name}", job_name=name, rank=0, device=0, node="n")
            out += [_line(t, tag, Grant(iteration=i, waited_s=0.0)),
                    _line(t + held_s, tag, Release(held_s=held_s)),
                    _line(t + held_s + comm_s, tag, CommEnd(iteration=i, duration_s=comm_s))]
        return out
    ranks = [{"rank": 0, "iter_end": [1.3, 1.6, 1.9], "batch": 8}]
    raw = {"jobs": {"hi": ranks, "lo": ranks}, "visitors": {},
           "events": {"node0": sorted(job("hi", 0.080, 0.110) + job("lo", 0.030, 0.070), key=lambda e: e["t"]),
                      "node1": job("hi", 0.5, 0.5)}}
    seg = {"a": 0.9, "b": 2.5, "running": ["hi", "lo"], "cycle": 0, "mode": "classes", "load1": 0.0}
    jobs = analyse_segment(raw, seg)["jobs"]
    assert (jobs["hi"]["C_ms"], jobs["hi"]["M_ms"]) == pytest.approx((80.0, 110.0))
    assert (jobs["lo"]["C_ms"], jobs["lo"]["M_ms"]) == pytest.approx((30.0, 70.0))
