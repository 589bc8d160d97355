"""Memory reservations by class, end to end: a real crossoverd with `--reserve`, real `torchrun` jobs of two ranks,
and the emulated device's memory (`testbed.device_model`), whose allocator the plugin caps as it caps torch's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crossover.protos.event_records import MemoryCap
from testbed.harness.daemon import cli, kill_group
from testbed.harness.jobs import Job, exit_outcome, torchrun, with_import
from testbed.harness.polling import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MiB = 1 << 20
DEVICE_MB, CONTEXT_MB = 10240, 300
PROD = ("--device-memory-mb", "2000", "--device-memory-growth-mb", "100", "--device-memory-max-mb", "3000")
LOW = ("--device-memory-mb", "500", "--device-memory-growth-mb", "200")


@pytest.fixture
def device(tmp_path):
    """The node's emulated device: 10 GiB, each context 300 MiB outside its pool."""
    path = tmp_path / "dev.sock"
    log = open(tmp_path / "device.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "testbed.device_model.server", "--socket", str(path),
                             "--memory-mb", str(DEVICE_MB), "--context-mb", str(CONTEXT_MB)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: path.exists() or proc.poll() is not None, 20, "the device server to start")
    assert proc.poll() is None, (tmp_path / "device.log").read_text()
    yield path
    kill_group(proc)
    proc.wait()
    log.close()


def start(name: str, tmp: Path, daemon_socket: Path, device: Path, iters: int, memory: tuple[str, ...],
          priority: str = "") -> Job:
    env = {"CROSSOVER_SOCKET": str(daemon_socket), "EMULATED_DEVICE_SOCKET": str(device),
           **({"CROSSOVER_PRIORITY": priority} if priority else {})}
    args = ("--framework", "ddp", "--iters", str(iters), "--device-ms-per-sample", "0.02", "--batch", "256",
            "--width", "64", "--in-dim", "32", "--samples", "2048", *memory)
    return torchrun(name, with_import(tmp, "train_bench.py"), tmp, args=args, env=env, stoppable=True)


def test_a_low_job_that_grows_is_stopped_at_its_cap_and_the_production_job_never_fails(
        daemon_factory, device, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover", "--cpu-device-memory", f"{DEVICE_MB}MiB",
                       "--reserve", "high=75%", "--class-rule", f"uid:{os.getuid()}=high")
    prod = start("prod", tmp_path, d.socket, device, 100_000, PROD)
    jobs.append(prod)
    wait_until(lambda: any(e.name == "register" and e.job_name == "prod" for e in d.events()), 60,
               "prod to register")
    low = start("batch", tmp_path, d.socket, device, 40, LOW, priority="low")
    jobs.append(low)

    assert exit_outcome(low, 200) == "failed", "the growing low job was not stopped"
    out = low.output()
    assert "ran out of its memory cap on device 0" in out and "crossoverd --reserve" in out, out[-3000:]
    assert prod.proc.poll() is None, f"the production job ended:\n{prod.output()[-3000:]}"
    prod.stop(ahead=5)
    assert exit_outcome(prod, 200) != "failed", f"the production job failed:\n{prod.output()[-3000:]}"
    assert len(prod.summaries()) == 2

    events = d.events()
    told = {(e.rank, MemoryCap.of(e).cap_bytes) for e in events if e.name is MemoryCap.name and e.job_name == "batch"}
    share = (DEVICE_MB * MiB - int(0.75 * DEVICE_MB * MiB)) // 2  # its two ranks share what high leaves
    assert {(0, share), (1, share)} <= told, told
    assert not [e for e in events if e.name == "memory_cap" and e.job_name == "prod"]
    hits = [e for e in events if e.name == "memory_cap_hit"]
    assert hits and {e.job_name for e in hits} == {"batch"}


def test_caps_follow_a_class_change_and_a_job_leaving(daemon_factory, device, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover", "--cpu-device-memory", f"{DEVICE_MB}MiB",
                       "--reserve", "high=50%")
    small = ("--device-memory-mb", "200")
    a = start("alpha", tmp_path, d.socket, device, 100_000, small)
    b = start("beta", tmp_path, d.socket, device, 100_000, small)
    jobs.extend([a, b])
    wait_until(lambda: len({e.job_name for e in d.events() if e.name == "register"}) == 2, 90,
               "both jobs to register")
    assert not [e for e in d.events() if e.name == "memory_cap"], "a cap without an active reservation"

    cli("priority", "alpha", "high", socket=d.socket)
    half = (DEVICE_MB * MiB - DEVICE_MB * MiB // 2) // 2
    wait_until(lambda: {MemoryCap.of(e).cap_bytes for e in d.events() if e.name is MemoryCap.name
                        and e.job_name == "beta"} == {half}, 30, "beta to be capped")
    jobs = json.loads(cli("jobs", "--json", socket=d.socket).stdout)["jobs"]
    beta = next(j for j in jobs if j["job_name"] == "beta")
    assert [r["memory_cap_bytes"] for r in beta["ranks"]] == [half, half], beta  # 2.5 GiB each, 5 GiB the job

    cli("priority", "alpha", "normal", socket=d.socket)
    cli("priority", "beta", "high", socket=d.socket)
    wait_until(lambda: any(e.name is MemoryCap.name and e.job_name == "alpha" and MemoryCap.of(e).cap_bytes == half
                           for e in d.events()), 30, "alpha to be capped once beta is high")
    lifted = [e for e in d.events() if e.name == "memory_cap" and e.job_name == "beta"][-1]
    assert MemoryCap.of(lifted).cap_bytes is None

    b.stop(ahead=5)
    assert exit_outcome(b, 120) != "failed", b.output()[-3000:]
    wait_until(lambda: [MemoryCap.of(e) for e in d.events() if e.name is MemoryCap.name and e.job_name == "alpha"][-1]
               .cap_bytes is None, 30, "beta's leaving to free its reservation")
    a.stop(ahead=5)
    assert exit_outcome(a, 120) != "failed", a.output()[-3000:]
