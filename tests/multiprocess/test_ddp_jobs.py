"""Real `torchrun` DDP jobs (Gloo, two ranks each) scheduled by a real crossoverd through `import crossover.auto`."""
from __future__ import annotations

import collections
import socket
import time

import pytest

from crossover.protos.event_records import Register, Release
from testbed.harness.daemon import queue_state
from testbed.harness.jobs import WORKLOADS, Job, exit_outcome, horovodrun, torchrun, with_import
from testbed.harness.oracles import compute_intervals, overlaps

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ITERS = 40
# Every pattern of issue 53 runs as a 2-rank job beside another pattern's 2-rank job, sharing devices, under both
# policies and with one and two devices (`python -m bench.ddp_patterns` runs each pattern beside itself in all four).
PAIRS = [
    ("plain", "no_sync", "exclusive", 1),
    ("find_unused", "static_graph", "crossover", 1),
    ("bucket_view", "fp16_hook", "exclusive", 2),
    ("zero", "checkpoint", "crossover", 2),
    ("metric", "compile", "crossover", 1),
]


def finished(job: Job, timeout: float = 200) -> None:
    """The job exited 0, or torch's Gloo teardown aborted a rank after every rank wrote its summary (the last line
    of the script): that abort is torch's at interpreter exit (issue 53), never a failure of training."""
    outcome = exit_outcome(job, timeout)
    out = job.output()
    assert outcome != "failed", f"{job.name} exited {job.proc.returncode}:\n{out[-3000:]}"
    assert "unscheduled" not in out, f"{job.name} fell back to training unscheduled:\n{out[-3000:]}"
    digests = {s["digest"] for s in job.summaries()}
    assert len(digests) == 1, f"{job.name}'s ranks diverged"


@pytest.mark.parametrize(("left", "right", "policy", "devices"), PAIRS,
                         ids=[f"{a}+{b}-{p}-{n}dev" for a, b, p, n in PAIRS])
def test_co_located_ddp_patterns_are_scheduled_and_finish(daemon_factory, jobs, tmp_path, left, right, policy,
                                                          devices):
    d = daemon_factory("--cpu-devices", str(devices), "--policy", policy)
    script = with_import(tmp_path, "train_ddp.py")
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    for pattern in (left, right):
        jobs.append(torchrun(pattern, script, tmp_path, args=("--pattern", pattern, "--iters", str(ITERS)), env=env))
    for job in jobs:
        finished(job)

    events = d.events()
    registered = {(e.job_name, Register.of(e).framework) for e in events if e.name is Register.name}
    assert registered == {(left, "ddp"), (right, "ddp")}
    grants = collections.Counter(e.job_name for e in events if e.name == "grant")
    assert grants[left] >= ITERS and grants[right] >= ITERS, f"too few grants: {dict(grants)}"
    per_dev = compute_intervals(events)
    assert len(per_dev) == devices and all(len({iv[2] for iv in ivs}) == 2 for ivs in per_dev.values()), \
        "a device did not serve both jobs"
    if policy == "exclusive":
        for dev, intervals in per_dev.items():
            assert overlaps(intervals) == [], f"compute phases of the two jobs overlap on device {dev}"
    for pattern in {left, right} & {"metric", "checkpoint"}:  # their collectives hand the device back
        yields = [e for e in events if e.name is Release.name and e.job_name == pattern and Release.of(e).yields]
        assert yields, f"{pattern}: no release for a collective's wait in the log"


def test_passthrough_is_bit_identical_to_plain_ddp(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "passthrough")
    args = ("--pattern", "plain", "--iters", "30", "--workers", "2")
    jobs.append(torchrun("plain", WORKLOADS / "train_ddp.py", tmp_path, args=args))
    jobs.append(torchrun("hooked", with_import(tmp_path, "train_ddp.py"), tmp_path, args=args,
                         env={"CROSSOVER_SOCKET": str(d.socket)}))
    for job in jobs:
        finished(job)
    assert jobs[0].summaries()[0]["digest"] == jobs[1].summaries()[0]["digest"]
    assert any(e.name is Register.name and Register.of(e).framework == "ddp" for e in d.events())


def test_a_horovod_job_and_a_ddp_job_share_one_device(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover")
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    # The Horovod job trains until the DDP job has finished, however long torchrun takes to start on a busy machine.
    jobs.append(horovodrun("hvd", with_import(tmp_path), tmp_path, np=2, args=("--iters", "100000"), env=env,
                           stoppable=True))
    jobs.append(torchrun("ddp", with_import(tmp_path, "train_ddp.py"), tmp_path, args=("--iters", "60"), env=env))
    shown: dict[str, str] = {}  # what the operator sees: each job's framework in `crossover queue --json`
    deadline = time.monotonic() + 150
    while len(shown) < 2 and time.monotonic() < deadline and any(j.proc.poll() is None for j in jobs):
        for dev in queue_state(d.socket)["devices"]:
            for r in dev["holders"] + dev["waiting"] + dev["others"]:
                shown[r["job_name"]] = r.get("framework", "")
        time.sleep(0.1)
    assert shown == {"hvd": "horovod", "ddp": "ddp"}, shown
    finished(jobs[1])
    jobs[0].stop()
    assert jobs[0].wait(200) == 0, jobs[0].output()[-3000:]
    events = d.events()
    assert {(e.job_name, Register.of(e).framework) for e in events if e.name is Register.name} == {
        ("hvd", "horovod"), ("ddp", "ddp")}
    grants = collections.Counter(e.job_name for e in events if e.name == "grant")
    assert grants["hvd"] > 0 and grants["ddp"] > 0, dict(grants)
    per_dev = compute_intervals(events)
    assert len({iv[2] for iv in per_dev[0]}) == 2


def test_an_elastic_restart_re_attaches_as_the_same_job(daemon_factory, jobs, tmp_path):
    """Static rendezvous (run id "none": the job is its endpoint). Under `--standalone` torch 2.13's restarted Gloo
    workers read the failed attempt's addresses from the agent's store and never connect, with or without
    Crossover (docs/plugin.md, "DDP")."""
    d = daemon_factory("--cpu-devices", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = torchrun("elastic", with_import(tmp_path, "train_ddp.py"), tmp_path,
                   args=("--iters", "20", "--fail-once-at", "8"), env={"CROSSOVER_SOCKET": str(d.socket)},
                   launcher_args=("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                  "--master-port", str(port), "--max-restarts", "1"))
    jobs.append(job)
    finished(job)
    registers = [e for e in d.events() if e.name == "register"]
    assert len(registers) == 4, "two ranks, registered twice: before the failure and after the restart"
    assert len({e.job for e in registers}) == 1, "the restarted workers joined as another job"


def test_fsdp_trains_unchanged_and_unscheduled_with_one_line(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1")
    jobs.append(torchrun("plain", WORKLOADS / "train_fsdp.py", tmp_path))
    jobs.append(torchrun("fsdp", with_import(tmp_path, "train_fsdp.py"), tmp_path,
                         env={"CROSSOVER_SOCKET": str(d.socket)}))
    for job in jobs:
        assert job.wait(200) == 0, job.output()[-3000:]
    plain, hooked = ([s["digest"] for s in job.summaries()] for job in jobs)
    assert len(plain) == 2 and plain == hooked
    assert jobs[1].output().count("crossover does not track FSDP's phases") == 2  # one line per rank
    assert not [e for e in d.events() if e.name == "register"]
