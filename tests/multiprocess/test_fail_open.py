"""Crossover never hangs or crashes training: no daemon, a dead daemon, a stopped daemon."""
from __future__ import annotations

import signal
import time

import pytest

from crossover.protos.event_records import Leave
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import horovodrun, with_import
from testbed.harness.polling import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_no_daemon_trains_unscheduled_and_warns_once(jobs, tmp_path):
    script = with_import(tmp_path)
    job = horovodrun("lonely", script, tmp_path, np=2, args=("--iters", "30"),
                     env={"CROSSOVER_SOCKET": str(tmp_path / "absent.sock"), "CROSSOVER_RECONNECT_INTERVAL": "0.2"})
    jobs.append(job)
    assert job.wait(90) == 0, job.output()[-3000:]
    out = job.output()
    assert len(job.summaries()) == 2
    for rank in (0, 1):
        rank_lines = [line for line in out.splitlines() if line.startswith(f"[{rank}]") and "unscheduled" in line]
        assert len(rank_lines) == 1, f"rank {rank} should warn exactly once, got: {rank_lines}"


def test_daemon_killed_mid_run_then_restarted_job_reattaches(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "2", "--policy", "exclusive")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_RECONNECT_INTERVAL": "0.3"}
    job = horovodrun("phoenix", script, tmp_path, np=2, args=("--iters", "700"), env=env)
    jobs.append(job)
    wait_until(lambda: sum(e.name == "grant" for e in d.events()) >= 20, 60, "first grants")

    d.proc.send_signal(signal.SIGKILL)  # no clean shutdown: streams just break
    d.proc.wait()
    time.sleep(1.0)
    assert job.proc.poll() is None, "the job died with the daemon"

    d2 = DaemonProc(socket=d.socket, event_log=tmp_path / "d2.events.jsonl", log=tmp_path / "d2.log",
                    args=["--cpu-devices", "2", "--policy", "exclusive"]).start()
    try:
        wait_until(lambda: sum(e.name == "grant" and e.job_name == "phoenix" for e in d2.events()) >= 4,
                   60, "grants from the restarted daemon")
        assert job.wait(120) == 0, job.output()[-3000:]
    finally:
        d2.stop()
    out = job.output()
    assert "lost crossoverd" in out and "re-attached" in out
    assert len({s["digest"] for s in job.summaries()}) == 1


def test_sigterm_releases_waiting_ranks_and_exits_cleanly(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive")
    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_RECONNECT_INTERVAL": "60"}
    stop = tmp_path / "stop"
    for name in ("one", "two"):  # long enough that neither finishes before the other starts (start-up spread)
        jobs.append(horovodrun(name, script, tmp_path, np=1, args=("--iters", "4000", "--stop-file", str(stop)),
                               env=env))
    wait_until(lambda: {e.job_name for e in d.events() if e.name == "grant"} == {"one", "two"}, 60,
               "both jobs scheduled")
    t0 = time.monotonic()  # CLOCK_MONOTONIC, the event log's clock
    assert d.stop(signal.SIGTERM, timeout=10) == 0
    assert time.monotonic() - t0 < 5, "daemon took too long to stop"
    time.sleep(1.0)  # released, both train on unscheduled; then they may stop early
    stop.touch()
    for j in jobs:
        assert j.wait(120) == 0, j.output()[-3000:]
    events = d.events()
    assert not [e for e in events if e.name == "leave" and e.t < t0], "a job left before the SIGTERM"
    assert sorted((e.job_name, Leave.of(e).reason) for e in events if e.name is Leave.name) == [
        ("one", "daemon shutdown"), ("two", "daemon shutdown")]


def test_frozen_daemon_is_noticed_within_a_second_and_schedules_again_after(daemon_factory, tmp_path):
    """SIGSTOP: a rank waiting for a grant stops waiting once its heartbeat goes unanswered
    (CROSSOVER_DAEMON_SILENCE), not after the 30 s grant timeout; after SIGCONT it waits for grants again."""
    from crossover.client.rank.session import Session
    from crossover.protos.identity import RankIdentity
    from crossover.settings import PluginSettings

    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--no-lease", "--overdue-after", "600",
                       "--heartbeat-timeout", "5", "--evict-after", "60")
    settings = PluginSettings(target=f"unix://{d.socket}", job_name="", device=0, reconnect_interval_s=60.0,
                              pin=False, daemon_silence_s=1.0)
    holder, waiter = (Session(RankIdentity(f"job-{n}", n, 0, 0, 1, 1, device=0), settings).start()
                      for n in ("holder", "waiter"))
    try:
        assert holder.attached and waiter.attached
        wait_until(lambda: waiter._silence.answers, 5, "the daemon's first heartbeat answer")
        assert holder.acquire(0)
        d.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert waiter.acquire(0) is False  # the device is held and the daemon is frozen: train unscheduled
        noticed = time.monotonic() - t0
        assert noticed < 3.0, f"a frozen daemon took {noticed:.1f}s to notice"
        t1 = time.monotonic()
        assert waiter.acquire(1) is False, "a rank must not wait on a daemon it knows is frozen"
        assert time.monotonic() - t1 < max(noticed, 0.5), "it waited again as long as noticing took"
        waiter.release(1)
        d.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: not waiter._silence.frozen, 5, "the thawed daemon's answer")
        holder.release(0)
        assert waiter.acquire(2) is True, "after the daemon answers again the rank is scheduled again"
        waiter.release(2)
        wait_until(lambda: any(e.name == "grant" and e.job_name == "waiter" for e in d.events()), 5,
                   "the thawed daemon's grant to the waiter in its event log")
    finally:
        d.proc.send_signal(signal.SIGCONT)
        holder.close()
        waiter.close()
