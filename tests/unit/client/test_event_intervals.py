"""Phases and figures from hand-built event lists: the pairing rules of `crossover stats` and `timeline`."""
from __future__ import annotations

from typing import Any

import pytest

from crossover.client.cli.event_intervals import (
    Interval,
    UnknownJob,
    clip,
    compute_stats,
    job_labels,
    merge_logs,
    operator_marks,
    policy_changes,
    read_phases,
    select_jobs,
    union_length,
    window,
)
from crossover.protos.event_records import (
    CommBegin,
    CommEnd,
    Drain,
    Evict,
    Grant,
    Leave,
    Overdue,
    OverdueDone,
    Policy,
    RankTag,
    Record,
    Register,
    Release,
    Request,
    Resume,
    Suspend,
)

JOB_A = "aaaaaaaa11112222"
JOB_B = "bbbbbbbb33334444"


def ev(t: float, record: Record, job: str = JOB_A, rank: int = 0, device: int = 0, node: str = "n0") -> dict[str, Any]:
    """The line of `record` about a rank, as the daemon writes it."""
    tag = RankTag(job=job, job_name={JOB_A: "alpha", JOB_B: "beta"}.get(job, job), rank=rank, device=device, node=node)
    return {"t": t, "wall": 1000.0 + t, "event": str(record.name), **tag.fields(), **record.fields()}


def about_node(t: float, record: Record, **extra: Any) -> dict[str, Any]:
    """The line of `record` about the node or a device, with `extra` keys."""
    return {"t": t, "event": str(record.name), **record.fields(), **extra}


REQUEST, BEGIN = Request(iteration=0, seq=1), CommBegin(iteration=0)


def grant(waited_s: float) -> Grant:
    return Grant(iteration=0, waited_s=waited_s)


def comm_end(duration_s: float) -> CommEnd:
    return CommEnd(iteration=0, duration_s=duration_s)


def step(t0: float, wait: float, compute: float, comm: float, **who: Any) -> list[dict[str, Any]]:
    """One iteration as the daemon logs it: request, grant, release, comm_begin, comm_end."""
    g, r = t0 + wait, t0 + wait + compute
    return [ev(t0, REQUEST, **who), ev(g, grant(wait), **who), ev(r, Release(held_s=compute), **who),
            ev(r, BEGIN, **who), ev(r + comm, comm_end(comm), **who)]


def spans(intervals: list[Interval], phase: str, **match: Any) -> list[tuple[float, float]]:
    return [(iv.start, iv.end) for iv in intervals
            if iv.phase == phase and all(getattr(iv, k) == v for k, v in match.items())]


def test_grants_and_releases_pair_per_rank_even_when_interleaved():
    a, b = step(0.0, 0.0, 1.0, 0.5), step(0.2, 0.8, 1.0, 0.5, job=JOB_B)
    events = sorted(a + b, key=lambda e: e["t"])
    ivs = list(read_phases(events).intervals)
    assert spans(ivs, "compute", job=JOB_A) == [(0.0, 1.0)]
    assert spans(ivs, "compute", job=JOB_B) == [(1.0, 2.0)]
    assert spans(ivs, "wait", job=JOB_B) == [(0.2, 1.0)]
    assert spans(ivs, "comm", job=JOB_A) == [(1.0, 1.5)]
    assert all(iv.complete for iv in ivs)


def test_a_comm_end_without_its_beginning_is_dated_by_its_duration():
    events = [ev(5.0, comm_end(0.75)), ev(6.0, comm_end(0.0)), ev(6.5, BEGIN),
              ev(7.0, comm_end(0.2))]
    assert spans(list(read_phases(events).intervals), "comm") == [(4.25, 5.0), (6.5, 7.0)]


def test_a_release_without_a_grant_is_ignored():
    events = [ev(1.0, Release(held_s=0.5)), *step(2.0, 0.0, 1.0, 0.1),
              ev(4.0, REQUEST), ev(4.0, grant(0.0)), ev(4.5, Leave(reason="stream ended")),
              ev(4.5, Release(reason="stream ended"))]
    ivs = list(read_phases(events).intervals)
    assert spans(ivs, "compute") == [(2.0, 3.0), (4.0, 4.5)]
    assert [iv.complete for iv in ivs if iv.phase == "compute"] == [True, False], "a leave cuts the phase"


def test_events_dated_back_are_paired_in_time_order_not_line_order():
    # The request of iteration 1 rode along with its compute_done, so it is written after the grant it preceded.
    events = [ev(0.0, REQUEST), ev(0.0, grant(0.0)), ev(1.0, Release(held_s=1.0)),
              ev(1.0, BEGIN), ev(2.5, grant(0.5)), ev(2.0, comm_end(1.0)),
              ev(2.0, REQUEST), ev(3.0, Release(held_s=0.5))]
    ivs = list(read_phases(events).intervals)
    assert spans(ivs, "compute") == [(0.0, 1.0), (2.5, 3.0)]
    assert spans(ivs, "wait") == [(0.0, 0.0), (2.0, 2.5)]
    assert spans(ivs, "comm") == [(1.0, 2.0)]


def test_a_yield_is_compute_but_not_an_iteration():
    events = [ev(0.0, REQUEST), ev(0.0, grant(0.0)), ev(0.4, Release(held_s=0.4, yields=True)),
              ev(0.4, REQUEST), ev(0.6, grant(0.2)), ev(1.0, Release(held_s=0.4))]
    log = read_phases(events)
    s = compute_stats(log, 0.0, 1.0)
    assert s.jobs[0].iterations == 1
    assert s.jobs[0].compute_total_s == pytest.approx(0.8)
    assert s.devices[0].grants == 2


def test_an_overdue_holder_stops_holding_but_still_keeps_the_device_busy():
    events = [ev(0.0, REQUEST), ev(0.0, grant(0.0)), ev(3.0, Overdue(held_s=3.0, iteration=0, limit_s=3.0)),
              ev(5.0, OverdueDone(late_s=2.0)),
              ev(1.0, REQUEST, job=JOB_B), ev(3.0, grant(2.0), job=JOB_B),
              ev(4.0, Release(held_s=1.0), job=JOB_B)]
    log = read_phases(events)
    assert spans(list(log.intervals), "compute", job=JOB_A) == [(0.0, 3.0)]
    assert spans(list(log.intervals), "overdue") == [(3.0, 5.0)]
    s = compute_stats(log, 0.0, 10.0)
    assert s.devices[0].busy_fraction == pytest.approx(0.5), "overdue and the next holder overlap: counted once"
    assert {j.job_name: j.iterations for j in s.jobs} == {"alpha": 0, "beta": 1}


def test_a_phase_open_at_the_end_of_the_log_ends_with_its_nodes_log():
    events = [ev(0.0, REQUEST), ev(0.0, grant(0.0)), ev(2.0, BEGIN, job=JOB_B),
              ev(9.0, Register(pid=1, world_size=1), node="n1", rank=1)]
    ivs = list(read_phases(events).intervals)
    assert spans(ivs, "compute") == [(0.0, 2.0)], "n0's log ends at 2.0, not at n1's last event"
    assert spans(ivs, "comm") == [(2.0, 2.0)]
    assert not any(iv.complete for iv in ivs if iv.phase != "wait")


def test_a_window_cuts_phases_at_its_edges():
    events = step(0.0, 0.5, 2.0, 1.0) + step(3.5, 0.0, 2.0, 1.0)  # computes [0.5, 2.5] and [3.5, 5.5]
    log = read_phases(events)
    cut = clip(log.intervals, 1.5, 4.5)
    assert spans(cut, "compute") == [(1.5, 2.5), (3.5, 4.5)]
    assert [iv.complete for iv in cut if iv.phase == "compute"] == [True, False]
    assert spans(cut, "comm") == [(2.5, 3.5)]
    assert spans(cut, "wait") == [(3.5, 3.5)], "a zero wait inside the window is still a wait"
    s = compute_stats(log, 1.5, 4.5)
    (job,) = s.jobs
    assert job.iterations == 1
    assert job.compute_total_s == pytest.approx(2.0)
    assert job.compute_mean_s == pytest.approx(1.0)
    assert job.compute_share == pytest.approx(2.0 / 3.0)
    assert s.devices[0].busy_fraction == pytest.approx(2.0 / 3.0)
    assert s.devices[0].grants == 1, "the first grant came before the window"


def test_busy_is_the_union_of_holders_not_their_sum():
    # Under passthrough two ranks may compute on one device at once.
    events = [ev(0.0, grant(0.0)), ev(2.0, Release(held_s=2.0)),
              ev(1.0, grant(0.0), job=JOB_B), ev(3.0, Release(held_s=2.0), job=JOB_B),
              ev(0.5, grant(0.0), node="n1"), ev(1.5, Release(held_s=1.0), node="n1")]
    s = compute_stats(read_phases(events), 0.0, 4.0)
    assert [(d.node, d.busy_fraction) for d in s.devices] == [("n0", 0.75), ("n1", 0.25)]
    assert s.devices[0].holders == ("alpha/0", "beta/0")
    assert union_length([Interval("compute", "n", 0, "j", "j", 0, a, b, True) for a, b in
                         [(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]]) == pytest.approx(3.0)


def test_wait_statistics_and_ranks():
    waits = [0.0, 0.1, 0.2, 0.3, 1.0]
    events = []
    for i, w in enumerate(waits):
        events += step(10.0 * i, w, 1.0, 1.0, rank=i % 2, node=f"n{i % 2}")
    s = compute_stats(read_phases(events), 0.0, 50.0)
    (job,) = s.jobs
    assert job.ranks == (0, 1)
    assert job.iterations == 3, "rank 0 ended three compute phases, rank 1 two"
    assert job.wait_total_s == pytest.approx(1.6)
    assert job.wait_mean_s == pytest.approx(0.32)
    assert job.wait_max_s == pytest.approx(1.0)
    assert job.wait_p95_s == pytest.approx(1.0)  # by nearest rank: one of the waits
    assert job.comm_mean_s == pytest.approx(1.0)


def test_a_grant_without_its_request_takes_the_wait_it_reports():
    ivs = list(read_phases([ev(3.0, grant(0.5)), ev(4.0, Release(held_s=1.0))]).intervals)
    assert spans(ivs, "wait") == [(2.5, 3.0)]


def test_jobs_are_chosen_by_name_id_or_id_prefix():
    log = read_phases(step(0, 0, 1, 1) + step(0, 1, 1, 1, job=JOB_B))
    assert select_jobs(log, []) == {JOB_A, JOB_B}
    assert select_jobs(log, ["alpha"]) == {JOB_A}
    assert select_jobs(log, [JOB_B]) == {JOB_B}
    assert select_jobs(log, ["bbbbbbbb33", "alpha"]) == {JOB_A, JOB_B}
    with pytest.raises(UnknownJob, match="'gamma'.*alpha, beta"):
        select_jobs(log, ["gamma"])
    with pytest.raises(UnknownJob):
        select_jobs(log, ["bbb"])  # too short to be an id prefix
    s = compute_stats(log, 0.0, 5.0, select_jobs(log, ["beta"]))
    assert [j.job_name for j in s.jobs] == ["beta"]
    assert s.devices[0].holders == ("beta/0",)


def test_two_jobs_with_one_name_are_told_apart():
    assert job_labels({JOB_A: "x", JOB_B: "x", "c": "y"}) == {JOB_A: "x (aaaaaaaa)", JOB_B: "x (bbbbbbbb)", "c": "y"}


def test_window_counts_from_the_first_event_or_back_from_the_last():
    log = read_phases([ev(10.0, Register(pid=1, world_size=1)), ev(40.0, Leave(reason="stream ended"))])
    assert window(log) == (10.0, 40.0)
    assert window(log, 5, 20) == (15.0, 30.0)
    assert window(log, -10) == (30.0, 40.0)
    assert window(log, None, -25) == (10.0, 15.0)


def test_logs_of_two_nodes_are_put_on_one_clock_by_their_wall_time():
    # Two daemons whose monotonic clocks differ by 1000 s; their wall clocks agree.
    n0 = [{"t": 5.0, "wall": 100.0, "event": "grant"}, {"t": 6.0, "wall": 101.0, "event": "release"}]
    n1 = [{"t": 1005.5, "wall": 100.5, "event": "grant"}, {"t": 1007.0, "wall": 102.0, "event": "release"},
          {"t": "x", "event": "junk"}, ["not", "an", "event"]]
    merged = merge_logs([n0, n1])
    assert [e.t for e in merged] == [0.0, 1.0, 0.5, 2.0]
    assert n0[0]["t"] == 5.0, "the caller's events are left as they were"


def test_a_policy_switch_logged_by_every_node_is_one_change():
    events = [about_node(5.0, Policy(old="crossover", new="exclusive", caller="")),
              about_node(5.01, Policy(old="crossover", new="exclusive", caller="")),
              ev(6.0, grant(0.0)),
              about_node(9.0, Policy(old="exclusive", new="turns", caller="")),
              about_node(20.0, Policy(old="turns", new="exclusive", caller=""))]
    assert policy_changes(events) == [(5.0, "exclusive"), (9.0, "turns"), (20.0, "exclusive")]


def test_a_suspended_rank_is_silent_not_in_an_allreduce_until_it_speaks():
    events = [ev(0.0, REQUEST), ev(0.0, grant(0.0)), ev(0.1, Release(held_s=0.1)),
              ev(0.1, BEGIN), ev(0.5, Suspend(reason="no heartbeat for 6.00s", phase="comm")),
              ev(6.5, Resume(silent_s=6.2)), ev(6.6, comm_end(0.05))]
    log = read_phases(events)
    assert spans(list(log.intervals), "suspended") == [(0.5, 6.5)]
    assert all(b <= 0.5 or a >= 6.5 for a, b in spans(list(log.intervals), "comm"))


def test_drains_resumes_and_evictions_are_marks_with_their_node():
    events = [about_node(1.0, Drain(device=0, caller=""), node="n0"),
              about_node(2.0, Evict(device=-1, job="resnet", touched=1, caller=""), node="n1"),
              about_node(3.0, Resume(device=0, caller=""), node="n0"),
              ev(4.0, Resume(silent_s=1.0))]  # a rank that speaks again is no operator's mark
    assert operator_marks(events) == [(1.0, "drain dev0 @n0"), (2.0, "evict job resnet @n1"),
                                      (3.0, "resume dev0 @n0")]


def test_stats_say_what_sharing_cost_each_job_and_bought_the_node():
    # two jobs alternating on one device: each computes 0.1 s and communicates 0.1 s, and waits
    # 0.1 s for the other; alone an iteration would take 0.2 s, shared it takes 0.3 s
    events = []
    for i in range(10):
        t = 0.3 * i
        events += step(t, 0.1, 0.1, 0.1, job=JOB_A)
        events += step(t + 0.1, 0.1, 0.1, 0.1, job=JOB_B, rank=0)
    log = read_phases(events)
    st = compute_stats(log, log.first, log.last)
    a = next(j for j in st.jobs if j.job_id == JOB_A)
    assert a.alone_s == pytest.approx(0.2)
    assert a.iteration_s == pytest.approx(0.3, rel=0.05)
    assert a.slowdown == pytest.approx(1.5, rel=0.05)
    assert st.sharing_gain == pytest.approx(2 / 1.5, rel=0.05)  # 1.33 jobs' worth from one device
