"""Aggregation rules in real `horovodrun` jobs: the plugin's Adasum against the float64 reference
(Gloo, 2/3/4 ranks, inside a process set) and against Horovod's native Adasum (MPI, 2 ranks);
weighted aggregation against one process training on the whole global batch; LB-BSP shrinking
the batch of an injected straggler."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from testbed.harness.jobs import WORKLOADS, horovodrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

CHECK = WORKLOADS / "aggregation_check.py"
TRAIN = WORKLOADS / "train_classifier.py"
F64_TOL, F32_TOL = 1e-6, 1e-4


def _run(jobs, tmp_path, name, script, np, args, env=None, mpi=False, timeout=110):
    job = horovodrun(name, script, tmp_path, np=np, args=args, env=env, mpi=mpi)
    jobs.append(job)
    assert job.wait(timeout) == 0, job.output()[-4000:]
    summaries = job.summaries()
    assert len(summaries) == np, job.output()[-4000:]
    return summaries


def _tolerance(check: str) -> float:
    return F64_TOL if "float64" in check else F32_TOL


@pytest.mark.parametrize("np", [2, 3, 4])
def test_plugin_adasum_matches_the_reference_under_gloo(np, jobs, tmp_path):
    args = ("adasum",) + (("--process-set", "0,1,2") if np == 4 else ())
    summaries = _run(jobs, tmp_path, f"adasum{np}", CHECK, np, args)
    for s in summaries:
        assert s["mpi_enabled"] is False  # Gloo: Horovod's own Adasum cannot run here
        checks = s["checks"]
        expected = {f"global/{d}/{a}" for d in ("float64", "float32") for a in ("allgather", "recursive_doubling")}
        if np == 4 and s["rank"] < 3:
            expected |= {e.replace("global", "process_set") for e in expected}
        assert set(checks) == expected
        for name, result in checks.items():
            assert result["max_rel_err"] <= _tolerance(name), (s["rank"], name, result)
            assert result["rank_spread"] == 0.0, (s["rank"], name, result)


def test_plugin_adasum_matches_horovods_native_adasum_under_mpi(jobs, tmp_path):
    summaries = _run(jobs, tmp_path, "adasum-mpi", CHECK, 2, ("adasum", "--native"), mpi=True)
    for s in summaries:
        assert s["mpi_enabled"] is True
        for dtype in ("float64", "float32"):
            result = s["checks"][f"native/{dtype}"]
            tol = _tolerance(dtype)
            assert result["plugin_vs_native"] <= tol and result["native_vs_ref"] <= tol, result
            assert s["checks"][f"global/{dtype}/allgather"]["max_rel_err"] <= tol
        # a few optimizer steps: Horovod's delta-based Adasum optimizer and the plugin's agree
        assert s["optimizer_moved"] > 0.1
        assert s["optimizer_plugin_vs_native"] <= 1e-5


def _single_process_reference(sizes: list[int], steps: int, lr: float) -> list[list[float]]:
    """One process, one optimizer, the whole global batch of B = Σ b_i samples per step."""
    from crossover.plugins.aggregation.lbbsp.sampler import WeightedBatchSampler
    from testbed.workloads.aggregation_check import weighted_dataset, weighted_model

    x, y = weighted_dataset()
    model = weighted_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sampler = WeightedBatchSampler(len(x), 0, 1, [sum(sizes)], seed=5, drop_last=True)
    batches = [b for _ in range(steps) for b in sampler][:steps]
    for indices in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[indices]), y[indices]).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _max_rel(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(u) - torch.tensor(v)).norm() / torch.tensor(v).norm()) for u, v in zip(a, b))


def test_weighted_aggregation_equals_one_batch_of_the_global_size(jobs, tmp_path):
    sizes, steps = [5, 11, 16], 4
    summaries = _run(jobs, tmp_path, "weighted", CHECK, 3, ("weighted", "--sizes", ",".join(map(str, sizes)),
                                                              "--steps", str(steps)))
    expected = _single_process_reference(sizes, steps, lr=0.1)
    for s in summaries:
        assert _max_rel(s["weighted"], expected) <= 1e-10
        # plain averaging of unequal batches is a different update: the check can tell them apart
        assert _max_rel(s["average"], expected) > 1e-3


def test_lbbsp_shrinks_the_batch_of_a_straggler(jobs, tmp_path):
    runs = [{"name": "lbbsp", "rule": None, "straggler": "1:3.0", "straggler_work": "sleep", "epochs": 3,
             "global_batch": 128, "evals_per_epoch": 1}]
    env = {"CROSSOVER_AGGREGATION": "weighted", "CROSSOVER_LBBSP_PERIOD": "3"}
    summaries = _run(jobs, tmp_path, "lbbsp", TRAIN, 2, ("--runs", json.dumps(runs), "--pace", "2"), env=env)
    for s in summaries:
        run = s["runs"][0]
        assert run["aggregation"] == "weighted"  # selected by CROSSOVER_AGGREGATION in a real job
        stats = run["lbbsp"]
        first, last = stats["history"][0][1], stats["sizes"]
        assert first == [64, 64]
        assert sum(last) == 128
        assert last[1] < 0.75 * last[0], stats["history"]  # 3x slower: ideally 96/32
        assert stats["steps"] == run["steps"] == 33
    assert summaries[0]["runs"][0]["final_acc"] == summaries[1]["runs"][0]["final_acc"]


def test_a_fast_rank_shutting_down_does_not_crash_a_slow_one_with_a_share_in_flight(jobs, tmp_path):
    # The last step starts an LB-BSP measurement exchange that no step reads; rank 0 then
    # calls hvd.shutdown() while rank 1 is still 2 s inside its update. Horovod must not
    # shut down under rank 1 before it has submitted its half.
    summaries = _run(jobs, tmp_path, "late", CHECK, 2, ("late-share", "--sizes", "5,11", "--steps", "4",
                                                        "--late", "2.0"))
    assert summaries[0]["weighted"] == summaries[1]["weighted"]
    # rank 0 really was done long before rank 1 (else this proves nothing)
    assert summaries[1]["shutdown_at"] - summaries[0]["shutdown_at"] > 1.5
