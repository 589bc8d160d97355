"""Conformance: real scripts as two co-located jobs must finish, as fast as unscheduled within 2x, never overlapping.

Every pair runs under `passthrough` first (the baseline, measured side by side
in the same test), then under `exclusive` and `crossover`, with one rank of
each job per device (`--cpu-devices 2`) and with both ranks of a job on one
device (`--cpu-devices 1`). The scripts are plain Horovod (`patterns.py`)
with `import crossover.auto` added; each pair exercises Horovod calls outside
the optimizer somewhere in its loop. A hang fails as a timeout with the logs.
Wall times go to `results/conformance.json` for the closing table.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conformance.judge import PLACEMENTS, judge_colocated_run, record_conformance
from tools.harness.jobs import WORKLOADS, horovodrun, with_import

pytestmark = [pytest.mark.multiprocess, pytest.mark.conformance, pytest.mark.timeout(600)]

# name -> (job A's flags, job B's flags, extra env per job)
PAIRS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[dict[str, str], dict[str, str]]]] = {
    # Horovod's ImageNet example: a metric allreduce per batch, backward_passes_per_step, a broadcast
    # of the resume epoch, an averaged evaluation per epoch.
    "metric-per-step": (("--metric", "--bpps", "2", "--eval"), ("--metric", "--bpps", "2", "--eval"), ({}, {})),
    # Gradient clipping (synchronize + skip_synchronize), step() without a backward, broadcast_object,
    # allgather_object and barrier; beside a GAN-like job with two optimizers and a metric.
    "clip-and-gan": (("--clip", "--no-backward-every", "5", "--object-sync"), ("--gan", "--metric"), ({}, {})),
    # DataLoader workers with an evaluation allreduce per epoch (pytorch_mnist's metric_average),
    # beside LB-BSP (weighted aggregation, its sampler and its own share exchange).
    "loader-and-lbbsp": (("--workers", "2", "--eval"), ("--lbbsp", "--metric"),
                         ({}, {"CROSSOVER_AGGREGATION": "weighted", "CROSSOVER_LBBSP_PERIOD": "5"})),
    # The plugin's Adasum (its allgathers run inside step()) on both jobs, with a metric.
    "adasum": (("--metric",), ("--metric", "--eval", "--object-sync"),
               ({"CROSSOVER_AGGREGATION": "adasum"}, {"CROSSOVER_AGGREGATION": "adasum"})),
}


def _run_pair(daemon_factory, jobs, tmp: Path, pair: str, policy: str, devices: str) -> dict:
    flags_a, flags_b, (env_a, env_b) = PAIRS[pair]
    tmp.mkdir(exist_ok=True)
    d = daemon_factory("--cpu-devices", devices, "--policy", policy, name=f"{policy}")
    script = with_import(tmp, WORKLOADS / "patterns.py")
    started = time.monotonic()
    mine = []
    for name, flags, env in (("A", flags_a, env_a), ("B", flags_b, env_b)):
        job = horovodrun(f"{policy}-{name}", script, tmp, np=2, args=flags,
                         env={"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_GRANT_TIMEOUT": "60",
                              "CROSSOVER_STATS_FILE": str(tmp / f"stats-{policy}-{name}-{{rank}}.json"), **env})
        jobs.append(job)
        mine.append(job)
    for job in mine:
        rc = job.wait(240)
        assert rc == 0, f"{pair}/{policy}: job {job.name} exited {rc}:\n{job.output()[-3000:]}"
        digests = {s["digest"] for s in job.summaries()}
        assert len(job.summaries()) == 2 and len(digests) == 1, f"{pair}/{policy}: ranks of {job.name} diverged"
    wall = time.monotonic() - started
    d.stop()
    events = d.events()
    yields = sum(json.loads(p.read_text()).get("yields", 0) for p in tmp.glob(f"stats-{policy}-*.json"))
    return {"wall_s": wall, "events": events, "yields": yields}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_colocated_pair_finishes_without_overlap(daemon_factory, jobs, tmp_path, pair, placement):
    devices = PLACEMENTS[placement]
    row: dict[str, float | int | str] = {"pair": pair, "placement": placement}
    base = _run_pair(daemon_factory, jobs, tmp_path / "passthrough", pair, "passthrough", devices)
    row["passthrough_s"] = round(base["wall_s"], 2)
    for policy in ("exclusive", "crossover"):
        run = _run_pair(daemon_factory, jobs, tmp_path / policy, pair, policy, devices)
        judge_colocated_run(f"{pair}/{policy} on {placement}", policy, run, base, row)
    record_conformance(row)
