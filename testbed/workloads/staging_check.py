"""Real Horovod ranks through `HostStager` on the CPU: what comes back equals Horovod's own allreduce.

Staging applies to CUDA tensors; here the stager's device side is a stand-in
(the host copy a clone, each copy out finishing 2 ms later on a clock, the copy
back a copy), so that real Horovod enqueues from the stager's thread and
reduces what it hands over. Checked on every rank: single and grouped
allreduces (average, sum, pre- and post-scaled, polled or waited for) against
Horovod's own, and a model trained with Horovod's DistributedOptimizer through
`horovod_waits` with staging forced on (tensor by tensor, and grouped) against the same model without it.
Writes `{"max_abs_diff": {...}, "params_identical": bool, "staged_in_training": N}` per rank to --out.
"""
import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

from crossover.plugins.hook import horovod_waits
from crossover.plugins.hook.host_staging import HostStager, stages
from crossover.plugins.hook.runtime import RUNTIME


class SlowCopy:
    """Host copies that are done 2 ms after they are made, as a GPU's copy out is some time after it is queued."""

    @staticmethod
    def to_host(tensor):
        return tensor.clone()

    marks = 0

    @staticmethod
    def mark(tensors):
        SlowCopy.marks += 1
        return time.monotonic() + 0.002

    @staticmethod
    def wait(done_at):
        time.sleep(max(0.0, done_at - time.monotonic()))

    @staticmethod
    def copy_back(tensor, host):
        tensor.copy_(host)


def _direct(stager, mpi_ops):
    diffs = {}
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    cases = {"average": {"op": hvd.Average}, "sum": {"op": hvd.Sum},
             "scaled": {"op": hvd.Sum, "prescale_factor": 0.5, "postscale_factor": 3.0}}
    for case, kwargs in cases.items():
        t = torch.randn(1000, generator=gen)
        want = hvd.allreduce(t, name=f"want.{case}", **kwargs)
        mine = t.clone()
        handle = stager.allreduce_async_(mine, name=f"staged.{case}", **kwargs)
        if case == "sum":
            while not stager.poll(handle, mpi_ops.poll):
                time.sleep(0.001)
        got = stager.synchronize(handle, mpi_ops.synchronize)
        assert got is mine
        diffs[case] = float((got - want).abs().max())
    group = [torch.randn(n, generator=gen) for n in (3, 500, 40)]
    want = hvd.grouped_allreduce(group, name="want.group", op=hvd.Average)
    mine = [g.clone() for g in group]
    got = stager.synchronize(stager.grouped_allreduce_async_(mine, name="staged.group", op=hvd.Average),
                             mpi_ops.synchronize)
    diffs["grouped"] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    return diffs


def _train(staging, groups, steps=5):
    # CPU tensors are never staged otherwise; which calls may be is still the plugin's rule
    horovod_waits._staging = lambda tensors, args, kwargs: staging and stages(args, kwargs)  # noqa: SLF001
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), num_groups=groups)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    hvd.init()
    import horovod.torch.mpi_ops as mpi_ops

    stager = HostStager(mpi_ops.allreduce_async_, mpi_ops.grouped_allreduce_async_, device=SlowCopy)
    diffs = _direct(stager, mpi_ops)
    horovod_waits.install(None)
    RUNTIME.stager = stager
    try:
        plain = _train(False, 0)
        before = SlowCopy.marks
        staged = [_train(True, 0), _train(True, 1)]
        through_optimizer = SlowCopy.marks - before
    finally:
        horovod_waits.uninstall()
        RUNTIME.stager = None
        stager.close()
    same = all(torch.equal(a, b) for run in staged for a, b in zip(plain, run))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"max_abs_diff": diffs, "params_identical": same, "staged_in_training": through_optimizer}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
