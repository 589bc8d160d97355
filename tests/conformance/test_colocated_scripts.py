"""Conformance: real scripts as two co-located jobs must finish, as fast as unscheduled within 2x, never overlapping.

Each pair (two 2-rank jobs) runs its script three times in the same rank
processes (`with_crossover.py --rounds`): a warm-up, unjudged; under
`passthrough` (the baseline, measured side by side in the same test); then one
round under both blocking policies, the daemon switched between `exclusive` and
`crossover` every quarter second (`judge.ALTERNATING_ROUNDS`), so each serves
six to sixteen stretches of it and every switch lands on running jobs. Between
rounds every rank waits with its device free. Placements: one rank of each job per
device (`--cpu-devices 2`), and both ranks of a job on one device
(`--cpu-devices 1`). The scripts are plain Horovod (`patterns.py`); each pair
exercises Horovod calls outside the optimizer somewhere in its loop. A hang
fails as a timeout with the logs. Wall times go to `judge.CONFORMANCE_RESULTS` (`~/.cache/crossover/conformance.json`)
for the closing table.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from testbed.harness.jobs import WORKLOADS, Job, horovodrun, rank_summaries
from tests.conformance.judge import (
    ALTERNATING_ROUNDS,
    PLACEMENTS,
    WITH_CROSSOVER,
    judge_rounds,
    record_conformance,
    run_pair_in_rounds,
)

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


# Their blocking rounds last 1.5-4 s: a quarter second gives each policy several stretches of every round.
_SWITCH_EVERY_S = 0.25


def _run_pairs(daemon_factory, jobs, tmp: Path, pair: str, devices: str) -> tuple[dict[str, float], list[dict]]:
    flags_a, flags_b, (env_a, env_b) = PAIRS[pair]
    per_job = {"A": (flags_a, env_a), "B": (flags_b, env_b)}

    def start(name: str, round_flags: tuple[str, ...], env: dict[str, str]) -> Job:
        flags, own_env = per_job[name]
        return horovodrun(name, WITH_CROSSOVER, tmp, np=2, out_flag=False, env={**env, **own_env},
                          args=(*round_flags, str(WORKLOADS / "patterns.py"),
                                "--out", str(tmp / f"out_{name}" / "round{round}"), *flags))

    walls, events = run_pair_in_rounds(daemon_factory, jobs, tmp, devices, pair, start, blocking=ALTERNATING_ROUNDS,
                                       switch_every_s=_SWITCH_EVERY_S)
    for name in per_job:
        for k, policy in enumerate(walls):
            summaries = rank_summaries(tmp / f"out_{name}" / f"round{k}")
            digests = {s["digest"] for s in summaries}
            assert len(summaries) == 2 and len(digests) == 1, f"{pair}/{policy}: ranks of {name} diverged"
    return walls, events


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_colocated_pair_finishes_without_overlap(daemon_factory, jobs, tmp_path, pair, placement):
    row: dict[str, float | int | str] = {"pair": pair, "placement": placement}
    walls, events = _run_pairs(daemon_factory, jobs, tmp_path, pair, PLACEMENTS[placement])
    judge_rounds(f"{pair} on {placement}", placement, walls, events, row)
    record_conformance(row)
