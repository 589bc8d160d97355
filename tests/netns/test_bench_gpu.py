"""`python -m bench.gpu --dry-run`, as CI runs it, so the GPU benchmark cannot rot between GPU draws.

The dry run takes every step the GPU run takes (the hand-over paths with a CPU
thread for a stream, the gap-cost probe beside a neighbour, a daemon's inventory, the
emulated two-node cluster, calibration, three co-located ResNet jobs as in
the GPU figures, unscheduled, exclusive, crossover (turns ended on the device
and on the CPU) and adaptive segments, a job alone,
the judge and the timeline) with node 0's device a CPU core and a small model on small images;
only the release check and the interprocess-event paths, which need CUDA, are skipped and say so.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from testbed.cluster import preflight
from testbed.cluster.netns import netns_list
from testbed.harness.jobs import CHECKOUT

_REASONS = preflight()

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(bool(_REASONS), reason="emulated cluster unavailable: " + "; ".join(_REASONS)),
]


@pytest.mark.timeout(300)
def test_the_dry_run_takes_every_step(tmp_path: Path) -> None:
    before = netns_list()
    res = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run", "--jobs", "3", "--adaptive",
                          "--adapt-window", "0.5", "--out", str(tmp_path)],
                         cwd=CHECKOUT, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    checks = report["checks"]
    assert [c for c, r in checks.items() if not r["ok"]] == []
    assert [d["kind"] for d in checks["inventory"]["devices"]] == ["cpu"]
    handover = checks["handover"]  # every hand-over path a CPU can take, through a real daemon and a shared page
    assert handover["daemon"]["gap"]["n"] > 0 and handover["slots"]["gap"]["n"] > 0, handover
    assert handover["slots"]["overlaps"] == 0 and set(handover["daemon"]["parts"]) == {"drain", "release_to_grant",
                                                                                        "ramp"}
    assert handover["kill"]["holder_exit"] == -9 and handover["kill"]["waiter"] == "ran after the rescue store"
    assert "need CUDA" in handover["ipc"]["skipped"] and handover["thrash"]["slowdown"] > 0
    assert "no CUDA" in checks["release"]["skipped"]
    gapcost = checks["gapcost"]  # the probe's steps alone and beside a neighbour, which trained meanwhile
    assert sorted(gapcost["median_ms"]) == ["alone", "free"] and gapcost["tensors"] > 10
    assert all(rate > 0 for rate in gapcost["neighbour_iters_per_s"].values()), gapcost
    summary = checks["speedup"]["summary"]
    for mode in ("sequential", "unscheduled", "exclusive", "crossover", "crossover-cpu", "adaptive"):
        assert summary["modes"][mode]["aggregate_samples_per_s"] > 0, mode
    assert sorted(summary["modes"]["crossover"]["jobs"]) == ["job0", "job1", "job2"]
    assert sorted(summary["modes"]["crossover"]["C_ms_by_node"]) == ["node0", "node1"]  # the GPU node's own C
    assert summary["alone_C_ms"] > 0 and summary["alone_M_ms"] > 0
    assert (tmp_path / "gpu_timeline.png").stat().st_size > 10_000
    assert "crossover" in res.stdout  # the table
    assert netns_list() <= before  # every namespace it made is gone


@pytest.mark.timeout(300)
def test_the_dry_run_of_ddp_jobs_takes_the_speedup_steps(tmp_path: Path) -> None:
    """`bench.gpu --framework ddp`: the same check with DDP jobs under torchrun (one per node), as the next GPU
    draw runs it."""
    with tempfile.TemporaryDirectory(prefix="xo") as work:  # short: the daemons' sockets live under it
        res = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run", "--only", "speedup", "--jobs", "2",
                              "--framework", "ddp", "--out", str(tmp_path), "--workdir", work],
                             cwd=CHECKOUT, capture_output=True, text=True, timeout=280)
        registers = [json.loads(line) for log in Path(work).rglob("node*.events.jsonl")
                     for line in log.read_text().splitlines() if '"register"' in line]
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    speedup = json.loads((tmp_path / "gpu.json").read_text())["checks"]["speedup"]
    assert speedup["ok"], speedup.get("error")
    modes = speedup["summary"]["modes"]
    for mode in ("sequential", "unscheduled", "exclusive", "crossover"):
        assert modes[mode]["aggregate_samples_per_s"] > 0, mode
    assert sorted(modes["crossover"]["jobs"]) == ["job0", "job1"]
    assert registers and {r.get("framework") for r in registers} == {"ddp"}
