"""Two real co-located horovodrun jobs scheduled by a real crossoverd."""
from __future__ import annotations

import itertools
import json
import os
import signal
import time

import pytest

from crossover.protos.event_phases import Interval, read_phases
from crossover.protos.event_records import Leave
from testbed.harness.daemon import cli, queue_state
from testbed.harness.jobs import horovodrun, with_import
from testbed.harness.oracles import compute_intervals, overlaps

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _queue(socket) -> dict:
    return queue_state(socket)


def _job_names(state: dict) -> set[str]:
    """Every job with a rank on some device in a `crossover queue --json` document."""
    return {r["job_name"] for dev in state["devices"] for r in dev["holders"] + dev["waiting"] + dev["others"]}


def _overtakes(waits: list[Interval], tie_s: float) -> dict[float, int]:
    """For each request on one device that a later request of another job overtook (asked more than `tie_s`
    after it, granted before it), how many did: request time -> count."""
    out: dict[float, int] = {}
    for w in waits:
        n = sum(1 for o in waits if o.job != w.job and o.start > w.start + tie_s and o.end < w.end)
        if n:
            out[round(w.start, 4)] = n
    return out


def test_exclusive_never_overlaps_and_queue_shows_both_jobs(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "2", "--policy", "exclusive")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    # Both run until the checks below have seen them together (on a loaded machine one job's start-up,
    # horovodrun and the torch import, can outlast another's whole run of 150 iterations), then stop.
    for name in ("alpha", "beta"):
        jobs.append(horovodrun(name, script, tmp_path, np=2, args=("--iters", "3000"), env=env, stoppable=True))

    seen: set[str] = set()  # the jobs in one snapshot: both must be there at the same time
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and seen != {"alpha", "beta"} and all(j.proc.poll() is None for j in jobs):
        state = _queue(d.socket)
        assert state["version"] == 2 and state["policy"] == "exclusive"
        assert all(len(dev["holders"]) <= 1 for dev in state["devices"])
        seen = _job_names(state)
        time.sleep(0.1)
    assert seen == {"alpha", "beta"}, f"the queue never showed both jobs at once while running (last saw {seen})"
    # The operator's view of the same thing, through the real CLI while the jobs run. The CLI's own start-up
    # takes a second or more on a loaded machine, by which time one job may be finishing, so it gets a few
    # looks while both jobs still run.
    names: set[str] = set()
    looks = 0
    while names != {"alpha", "beta"} and looks < 5 and all(j.proc.poll() is None for j in jobs):
        names = _job_names(json.loads(cli("queue", "--json", socket=d.socket).stdout))
        looks += 1
    leaves = [(e.job_name, Leave.of(e).reason) for e in d.events() if e.name is Leave.name]
    assert names == {"alpha", "beta"}, (f"`crossover queue --json` showed {names} in {looks} looks; "
                                        f"exit codes {[j.proc.poll() for j in jobs]}; ranks that left: {leaves}")

    for j in jobs:
        j.stop()
    steps = 0  # rank-iterations, every one of which asked for its device
    for j in jobs:
        assert j.wait(120) == 0, j.output()[-3000:]
        digests = {s["digest"] for s in j.summaries()}
        assert len(j.summaries()) == 2 and len(digests) == 1, "ranks of one job diverged"
        steps += sum(len(s["iter_times"]) for s in j.summaries())

    events = d.events()
    per_dev = compute_intervals(events)
    assert set(per_dev) == {0, 1}
    for dev, intervals in per_dev.items():
        assert {job for _, _, job, _ in intervals}.__len__() == 2, f"device {dev} did not serve both jobs"
        assert overlaps(intervals) == [], f"compute phases overlap on device {dev}"
    assert sum(1 for e in events if e.name == "grant") >= steps


def test_killed_grant_holder_frees_device_within_one_second(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    # `slow` holds the device for long compute phases; `fast` queues behind it on the same device.
    slow = horovodrun("slow", script, tmp_path, np=1, args=("--iters", "400", "--width", "1024", "--batch", "512"),
                      env=env)
    fast = horovodrun("fast", script, tmp_path, np=1, args=("--iters", "1500"), env=env)  # outlasts start-up spread
    jobs += [slow, fast]

    victim = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and victim is None:
        dev = _queue(d.socket)["devices"][0]
        names = [r["job_name"] for r in dev["waiting"]]
        if dev["holders"] and dev["holders"][0]["job_name"] == "slow" and "fast" in names:
            victim = dev["holders"][0]["pid"]
        else:
            time.sleep(0.02)
    assert victim, "never saw `slow` holding the device with `fast` waiting"
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()  # CLOCK_MONOTONIC is shared by every process on the host

    deadline = time.monotonic() + 5
    granted_at = None
    while time.monotonic() < deadline and granted_at is None:
        for e in d.events():
            if e.name == "grant" and e.job_name == "fast" and e.t > killed_at:
                granted_at = e.t
                break
        time.sleep(0.05)
    assert granted_at is not None, "the waiting job was never granted after the holder died"
    assert granted_at - killed_at <= 1.0, f"device freed {granted_at - killed_at:.3f}s after the kill"
    leave = [Leave.of(e) for e in d.events() if e.name is Leave.name and e.job_name == "slow"]
    assert leave and ("gone" in leave[0].reason or "stream" in leave[0].reason)
    assert fast.wait(120) == 0, fast.output()[-3000:]


def test_co_located_jobs_alternate_on_every_device(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "2", "--policy", "crossover")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    for name in ("left", "right"):  # both run until the queue shows them together, and 60 steps more
        jobs.append(horovodrun(name, script, tmp_path, np=2, args=("--iters", "3000"), env=env, stoppable=True))
    orders = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs) and ("left", "right") not in orders:
        for dev in _queue(d.socket)["devices"]:
            if len(dev["order"]) == 2:
                orders.add(tuple(sorted(dev["order"])))
        time.sleep(0.2)
    assert ("left", "right") in orders, "the queue never showed both jobs in its order"
    for j in jobs:
        j.stop(ahead=60)
    for j in jobs:
        assert j.wait(120) == 0, j.output()[-3000:]

    events = d.events()
    waits: dict[int, list[Interval]] = {}
    for iv in read_phases(events).intervals:
        if iv.phase == "wait" and iv.complete:
            waits.setdefault(iv.device, []).append(iv)
    for dev, intervals in compute_intervals(events).items():
        assert overlaps(intervals) == [], f"compute phases overlap on device {dev}"
        # From each job's fourth grant on: until its ranks on the other device have started too, a job's
        # first iterations wait for them, and the other job takes the device meanwhile (13 grants in a row
        # once, right after the later job's first grant).
        starts = {job: sorted(t0 for t0, _, j, _ in intervals if j == job) for job in {iv[2] for iv in intervals}}
        first = {job: times[min(3, len(times) - 1)] for job, times in starts.items()}
        last = {job: times[-1] for job, times in starts.items()}
        lo, hi = max(first.values()), min(last.values())
        seq = [job for t0, _, job, _ in sorted(intervals) if lo <= t0 <= hi]
        assert len(seq) >= 40, f"device {dev}: the jobs overlapped for only {len(seq)} grants"
        assert min(seq.count(j) for j in first) >= 0.1 * len(seq), f"device {dev}: one job was starved"
        # The jobs take turns. A run of one job's grants is right only while the other job does not ask
        # (work-conserving: its allreduce may be long, on a loaded machine); a request it makes is passed
        # over at most `max_overtakes` (1) times by a later one.
        switches = sum(a != b for a, b in zip(seq, seq[1:])) / (len(seq) - 1)
        runs = [len(list(group)) for _, group in itertools.groupby(seq)]
        print(f"device {dev}: {len(seq)} grants while both ran, {switches:.0%} alternate, longest run {max(runs)}")
        assert switches >= 0.6, f"device {dev}: {switches:.0%} of consecutive grants alternate, runs {runs[:40]}"
        assert len(waits.get(dev, [])) >= len(seq), f"device {dev}: fewer requests than grants in the log"
        passed_over = _overtakes(waits[dev], tie_s=0.002)
        assert max(passed_over.values(), default=0) <= 1, \
            f"device {dev}: requests passed over more than once (request time: times): {passed_over}"
