"""Conformance: Horovod 0.28.1's own PyTorch suite gives the same results with `import crossover.auto`.

`test/parallel/test_torch.py` from `../shared/peer/` (unmodified, run from
there) exercises every collective, blocking and async, on process sets, with
joins, broadcasts of state and objects, and the DistributedOptimizer's
options. It runs once as plain Horovod, then with the import against a real
daemon, with one rank per device and with both ranks on one device. While the
suite runs, the test switches the daemon between `exclusive` and `crossover`
every two seconds, as an operator's `crossover policy` does, so both policies
serve every kind of test in one run and every switch lands on a live job. The
counts and the failing tests must match plain Horovod's (on torch 2.13 three
tests fail on the Muon optimizer, which this Horovod predates), each policy
must have served the device many times (grants, or leases to a rank alone on
its device), and the event log must show no
overlapping compute phases and no holder the daemon had to pass over.

Plain Horovod's result is a property of the suite and the installed versions, not of our code, so
it is measured once per environment and kept in `plain_suite.json` beside this file, with what it
was measured under (the suite's SHA-256, Horovod's, torch's and Python's versions, the CPU count).
A run whose environment differs from the record runs the suite plain first, as before, and says so;
`CROSSOVER_PLAIN_SUITE=run` always does, `=record` also rewrites the record.

The daemon runs with `--overdue-after 20`: some tests compute for several
seconds in one phase (a 1000x1000 convolution), which the default 3 s floor
would take for a stall. A Horovod wait that kept its device would then show
as an `overdue` entry, and fail the test, instead of being served past.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.harness.daemon import kill_group
from testbed.harness.oracles import compute_intervals, overlaps
from testbed.harness.warm_horovodrun import start_horovodrun
from tests.conformance.judge import (
    ALTERNATE,
    PEER,
    PLACEMENTS,
    WITH_CROSSOVER,
    alternating_policies,
    events_by_policy,
    record_conformance,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.conformance, pytest.mark.timeout(900)]

SUITE = PEER / "test" / "parallel" / "test_torch.py"
PLAIN_RECORD = Path(__file__).with_name("plain_suite.json")
_log = logging.getLogger(__name__)
_SUMMARY = re.compile(r"^\[0\]<stdout>:=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s")
_FAILED = re.compile(r"^\[0\]<stdout>:FAILED \S+::(\w+::\w+)")


def _run_suite(tmp: Path, with_import: bool, env: dict[str, str] | None = None, timeout: float = 420) -> dict:
    """Run the suite under `horovodrun -np 2`; rank 0's counts and failing tests."""
    tmp.mkdir(parents=True, exist_ok=True)
    python = [sys.executable, str(WITH_CROSSOVER), "-m", "pytest"] if with_import else [sys.executable, "-m", "pytest"]
    cmd = ["-np", "2", "-H", "localhost:2", "--gloo", *python, "-q", "-p", "no:cacheprovider", str(SUITE)]
    log = tmp / "suite.log"
    started = time.monotonic()
    proc = start_horovodrun(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, log=log, cwd=tmp)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        pytest.fail(f"Horovod's suite did not finish in {timeout:.0f}s (with_import={with_import}):\n"
                    f"{log.read_text()[-3000:]}")
    text = log.read_text(errors="replace").splitlines()
    counts: dict[str, int] = {}
    for line in text:
        m = _SUMMARY.match(line)
        if m:
            for part in m.group(1).split(", "):
                n, word = part.split(" ", 1)
                if word != "warnings":
                    counts[word] = int(n)
    assert counts, f"no pytest summary from rank 0 (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
    return {"counts": counts, "failed": sorted({m.group(1) for line in text if (m := _FAILED.match(line))}),
            "wall_s": time.monotonic() - started}


def _environment() -> dict:
    """What plain Horovod's result depends on, other than the machine's luck."""
    import horovod
    import torch

    return {"suite_sha256": hashlib.sha256(SUITE.read_bytes()).hexdigest(), "horovod": horovod.__version__,
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    if not SUITE.exists():
        pytest.fail(f"{SUITE} is missing: CI and `make test` need ../shared beside the checkout")
    mode, env = os.environ.get("CROSSOVER_PLAIN_SUITE", ""), _environment()
    record = json.loads(PLAIN_RECORD.read_text()) if PLAIN_RECORD.exists() else {}
    if mode not in ("run", "record") and record.get("environment") == env:
        return {**record, "recorded": True}
    if mode not in ("run", "record"):
        _log.warning("plain Horovod's result for this environment is not recorded (%s): running the suite "
                     "plain first", env)
    got = _run_suite(tmp_path_factory.mktemp("plain"), with_import=False)
    if mode == "record":
        PLAIN_RECORD.write_text(json.dumps({"environment": env, **got}, indent=1) + "\n")
    return {**got, "recorded": False}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_horovod_suite_matches_plain_horovod(daemon_factory, tmp_path, plain, placement):
    d = daemon_factory("--cpu-devices", PLACEMENTS[placement], "--policy", ALTERNATE[0], "--overdue-after", "20",
                       name="suite")
    with alternating_policies(d.socket, placement) as switches:
        got = _run_suite(tmp_path / "suite", with_import=True,
                         env={"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_JOB_NAME": "suite"})
    d.stop()
    events = d.events()
    assert (got["counts"], got["failed"]) == (plain["counts"], plain["failed"]), \
        f"{placement}: with the import {got}, plain Horovod {plain}"
    cut = events_by_policy(events, first=ALTERNATE[0])
    # A rank alone on its device holds a lease (no grant per iteration): both count as served.
    served = {policy: sum(e.name in ("grant", "lease") for e in cut[policy]) for policy in ALTERNATE}
    assert sum(served.values()) > 100 and min(served.values()) >= 10, \
        f"{placement}: the suite was hardly scheduled (grants and leases per policy: {served})"
    for dev, intervals in compute_intervals(events).items():
        assert overlaps(intervals) == [], f"{placement}: compute phases overlap on device {dev}"
    overdue = [e for e in events if e.name == "overdue"]
    assert overdue == [], f"{placement}: a rank kept its device while waiting: {overdue[:3]}"
    record_conformance({"pair": "peer:test_torch.py", "placement": placement,
                        "plain_s": round(plain["wall_s"], 2), "plain_recorded": plain["recorded"],
                        "scheduled_s": round(got["wall_s"], 2),
                        "ratio": round(got["wall_s"] / plain["wall_s"], 2), "counts": got["counts"],
                        "policy_switches": len(switches), "grants_and_leases": served})
