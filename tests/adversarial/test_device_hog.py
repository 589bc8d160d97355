"""A live rank cannot keep a device: the daemon's own clock and --max-hold decide, not the rank's report.

Before: a rank that reported COMPUTE_DONE with duration_s=86400 set its own
liveness limit to ten days; holding its next grant while heartbeating, it kept
the device while the victim's ranks fell back to their grant timeout (30 s) and
trained unscheduled, again and again, with no `overdue` entry.
Now its compute time is what the daemon saw (10 ms), so its hold is overdue at
the floor (--overdue-after, 3 s by default) and the victim is served.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from attack_bed import answers_within, grant_waits, start_victim, stops_on_sigterm

from crossover.protos.event_records import Overdue
from testbed import checkout_on_path
from testbed.harness.daemon import cli, queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]

HOG = Path(__file__).with_name("hog_rank.py")


@pytest.fixture
def hog(tmp_path):
    """Start the hog against a daemon; returns once it holds the device for the second time. Killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(d) -> subprocess.Popen:
        status = tmp_path / "hog.status"
        env = {"PYTHONPATH": checkout_on_path({}), "PATH": "/usr/bin:/bin"}
        proc = subprocess.Popen([sys.executable, str(HOG), str(d.socket), "90", str(status)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        deadline = time.monotonic() + 20
        while not status.exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the hog never got its second grant"
            time.sleep(0.05)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_heartbeating_holder_is_moved_aside_within_the_floor(daemon_factory, jobs, hog, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--no-lease")
    held = hog(d)
    victim = start_victim(d, tmp_path)
    jobs.append(victim)
    assert victim.wait(150) == 0, victim.output()[-3000:]
    assert held.poll() is None  # the hog still holds on: the victim did not outlive it
    waits = grant_waits(d, "victim")
    # The first grant waits out the hog's hold (floor 3 s, reaped every 0.1 s); then the two jobs alternate.
    assert waits and max(waits) < 4.5, sorted(waits)[-3:]
    overdue = [e for e in d.events() if e.name == "overdue" and e.job_name == "hog"]
    assert len(overdue) == 1 and Overdue.of(overdue[0]).limit_s == pytest.approx(3.0)
    assert answers_within(d, 1.0) < 1.0
    held.kill()
    assert stops_on_sigterm(d) < 5.0


def test_the_operator_takes_the_device_back_and_removes_the_job(daemon_factory, jobs, hog, tmp_path):
    """With a floor no hog reaches (--overdue-after 600), `crossover evict 0` hands the device over at once,
    and `crossover evict --job hog` removes the hog's session."""
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--no-lease", "--overdue-after", "600",
                       "--overdue-warmup", "600")
    hog(d)
    victim = start_victim(d, tmp_path)
    jobs.append(victim)
    deadline = time.monotonic() + 30
    while not any(r for dev in queue_state(d.socket)["devices"] for r in dev["waiting"]):
        assert time.monotonic() < deadline, "the victim never queued"
        time.sleep(0.05)
    time.sleep(1.0)
    assert not grant_waits(d, "victim")  # the hog still holds the device
    out = cli("evict", "0", socket=d.socket)
    assert "hog rank 0 on device 0: moved aside" in out.stdout
    deadline = time.monotonic() + 5
    while not grant_waits(d, "victim"):
        assert time.monotonic() < deadline, "evict did not hand the device over"
        time.sleep(0.05)
    out = cli("evict", "--job", "hog", "--json", socket=d.socket)
    assert json.loads(out.stdout)["done"] == ["hog rank 0 on device 0: evicted"]
    assert not [r for dev in queue_state(d.socket)["devices"] for key in ("holders", "waiting", "others")
                for r in dev[key] if r.get("job_name") == "hog"]
    assert victim.wait(150) == 0, victim.output()[-3000:]
    assert max(grant_waits(d, "victim")[1:]) < 2.0
    assert [e.name for e in d.events()].count("evict") == 2
