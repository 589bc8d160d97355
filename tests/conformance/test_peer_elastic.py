"""Conformance: Horovod's elastic example grows and shrinks with `import crossover.auto`, and the daemon follows.

`examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py` from
`../shared/peer/` (unmodified: `hvd.elastic.run` with `TorchState`) is launched
with `horovodrun --min-np 2 --max-np 3 --host-discovery-script`. Once it trains,
the discovery script offers a third slot: Horovod resets, the new worker joins
and builds its optimizer while the others synchronise state. Once it trains
with three, the slot goes away again: the third worker is removed and the job
goes on with two. Meanwhile the daemon is switched between `exclusive` and
`crossover` every two seconds (`judge.alternating_policies`), so both serve the
growing and the shrinking. The job must exit 0, and the daemon's log must show
the third rank registered, the others registered anew for the new world, the
third rank gone after the shrink, and no overlapping compute phases.

What the environment forces: one host, so `--network-interface lo` (Horovod's
elastic Gloo launcher otherwise waits for two hosts to compare interfaces),
`--elastic-timeout 60` (a failed launch then ends instead of waiting 600 s),
a small model (`squeezenet1_1`) and batch, `--no-cuda`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossover.protos.event_records import Register
from testbed.harness.daemon import kill_group
from testbed.harness.oracles import compute_intervals, overlaps
from testbed.harness.polling import wait_until
from testbed.harness.warm_horovodrun import WarmProcess, start_horovodrun
from tests.conformance.judge import (
    ALTERNATE,
    PEER,
    WITH_CROSSOVER,
    alternating_policies,
    events_by_policy,
    record_conformance,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.conformance, pytest.mark.timeout(600)]

EXAMPLE = PEER / "examples" / "elastic" / "pytorch" / "pytorch_synthetic_benchmark_elastic.py"


def _wait_for(what: str, check, proc: WarmProcess, log: Path, timeout: float = 150) -> None:
    def ended() -> str | None:
        if proc.poll() is None:
            return None
        return f"the elastic job ended (exit {proc.returncode})"

    try:
        wait_until(check, timeout, what, interval=0.3, give_up=ended)
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{log.read_text()[-3000:]}")


def _registered(d) -> list[tuple[str, int]]:
    return [(e.name, e.rank) for e in d.events() if e.name in ("register", "leave")]


def _grow_and_shrink(proc: WarmProcess, log: Path, hosts: Path, d) -> int:
    """Offer a third slot once it trains, take it away once it trains with three; its exit code."""
    try:
        iters = lambda: log.read_text(errors="replace").count("Iter #")  # noqa: E731
        _wait_for("training with two workers", lambda: iters() >= 2, proc, log)
        hosts.write_text("localhost:3\n")
        _wait_for("a third rank registered", lambda: ("register", 2) in _registered(d), proc, log)
        grown = iters()
        _wait_for("training with three workers", lambda: iters() >= grown + 3, proc, log)
        hosts.write_text("localhost:2\n")
        return proc.wait(240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the elastic job did not finish:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()


def test_elastic_job_grows_and_shrinks_and_the_daemon_follows(daemon_factory, tmp_path):
    if not EXAMPLE.exists():
        pytest.fail(f"{EXAMPLE} is missing: CI and `make test` need ../shared beside the checkout")
    d = daemon_factory("--cpu-devices", "2", "--policy", ALTERNATE[0], name="elastic")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log = tmp_path / "job.log"
    cmd = ["-np", "2", "--min-np", "2", "--max-np", "3", "--network-interface", "lo",
           "--elastic-timeout", "60", "--host-discovery-script", str(discover), "--gloo",
           sys.executable, str(WITH_CROSSOVER), str(EXAMPLE), "--model", "squeezenet1_1",
           "--batch-size", "1", "--num-iters", "60", "--num-batches-per-iter", "2", "--num-warmup-batches", "1",
           "--no-cuda"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CROSSOVER_SOCKET": str(d.socket),
           "CROSSOVER_JOB_NAME": "elastic", "CROSSOVER_GRANT_TIMEOUT": "60"}
    started = time.monotonic()
    proc = start_horovodrun(cmd, env=env, log=log, cwd=tmp_path)
    with alternating_policies(d.socket, "elastic") as switches:
        rc = _grow_and_shrink(proc, log, hosts, d)
    wall = time.monotonic() - started
    text = log.read_text(errors="replace")
    assert rc == 0, f"the elastic job exited {rc}:\n{text[-3000:]}"
    assert "Total img/sec on 2 CPU(s)" in text, f"the job did not end with two workers:\n{text[-2000:]}"
    d.stop()
    events = d.events()
    worlds = {r: [Register.of(e).world_size for e in events if e.name is Register.name and e.rank == r]
              for r in (0, 1)}
    assert worlds == {0: [2, 3, 2], 1: [2, 3, 2]}, f"the daemon saw these worlds per rank: {worlds}"
    assert ("leave", 2) in _registered(d), "the removed rank never left the daemon"
    for dev, intervals in compute_intervals(events).items():
        assert overlaps(intervals) == [], f"compute phases overlap on device {dev}"
    cut = events_by_policy(events, first=ALTERNATE[0])
    grants = {policy: sum(e.name == "grant" for e in cut[policy]) for policy in ALTERNATE}
    assert all(grants.values()), f"a policy granted nothing while the job ran: {grants}"
    record_conformance({"pair": "peer:elastic", "placement": "2 -> 3 -> 2 workers on 2 devices",
                        "scheduled_s": round(wall, 2), "policy_switches": len(switches), "grants": grants})
