"""Numerical checks of the plugin's aggregation rules, run on every rank under `horovodrun`.

Modes (each rank writes `rank{r}.json` to --out):

* `adasum`: per-tensor Adasum of seeded random tensors (float64 and float32,
  both data-movement algorithms) through Horovod collectives, compared with the
  float64 reference of the pairwise tree computed locally (every rank can
  regenerate every rank's inputs from the seeds). With `--process-set 0,1,2`
  the same inside a process set. With `--native` (MPI controller, power-of-two
  ranks) also Horovod's `op=hvd.Adasum` on the same inputs, and a few steps of
  Horovod's Adasum optimizer against the plugin's on the same model and data.
* `late-share`: `weighted` training whose last step starts an LB-BSP
  measurement exchange, after which the last rank's optimizer is slow
  (`--late` seconds) while the others call `hvd.shutdown()` at once: every
  rank must still exit cleanly.
* `weighted`: a few SGD steps with fixed, unequal per-rank batch sizes under
  the `weighted` rule, then the same under plain `average`; the final
  parameters are compared (by the test) with one process training on the
  whole global batch.
"""
import argparse
import dataclasses
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

from crossover.plugins import aggregation
from crossover.plugins.aggregation.adasum.algorithms import adasum_allreduce_tensors, adasum_reference
from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import write_rank_summary

SHAPES = [(17,), (5, 7), (64,), (3, 4, 5), (1,)]


def inputs(global_rank: int, dtype: torch.dtype, case: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * case + global_rank)
    out = []
    for shape in SHAPES:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        # shared component so the tensors are neither orthogonal nor parallel
        shared = torch.randn(*shape, generator=torch.Generator().manual_seed(case), dtype=torch.float64)
        out.append((t + 0.7 * shared).to(dtype))
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def check_plugin(members: list[int], pset, tag: str, cases: int) -> dict:
    """Plugin Adasum among `members` (global ranks), vs the reference over their inputs."""
    coll = aggregation.HorovodCollectives(hvd, pset, name=f"check.{tag}")
    result: dict = {}
    for dtype in (torch.float64, torch.float32):
        for algorithm in ("allgather", "recursive_doubling"):
            worst, spread = 0.0, 0.0
            for case in range(cases):
                mine = inputs(hvd.rank(), dtype, case)
                coll.expect(dtype)
                got = adasum_allreduce_tensors(mine, coll, algorithm=algorithm)
                for index in range(len(SHAPES)):
                    ref = adasum_reference([inputs(r, dtype, case)[index] for r in members])
                    worst = max(worst, rel_err(got[index], ref))
                # every member must hold the same result
                flat = torch.cat([g.reshape(-1).double() for g in got])
                everyone = coll.allgather(flat)
                spread = max(spread, float((everyone - flat).abs().max()))
            result[f"{tag}/{str(dtype).split('.')[-1]}/{algorithm}"] = {"max_rel_err": worst, "rank_spread": spread}
    return result


def check_native(cases: int) -> dict:
    coll = aggregation.HorovodCollectives(hvd, None, name="check.native")
    members = list(range(hvd.size()))
    result: dict = {}
    for dtype in (torch.float64, torch.float32):
        vs_plugin, vs_ref = 0.0, 0.0
        for case in range(cases):
            mine = inputs(hvd.rank(), dtype, case)
            coll.expect(dtype)
            plugin = adasum_allreduce_tensors(mine, coll, algorithm="allgather")
            for index, tensor in enumerate(mine):
                native = hvd.allreduce(tensor, op=hvd.Adasum, name=f"native.{case}.{index}.{dtype}")
                ref = adasum_reference([inputs(r, dtype, case)[index] for r in members])
                vs_plugin = max(vs_plugin, rel_err(plugin[index], native))
                vs_ref = max(vs_ref, rel_err(native, ref))
        result[f"native/{str(dtype).split('.')[-1]}"] = {"plugin_vs_native": vs_plugin, "native_vs_ref": vs_ref}
    return result


def small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def train_adasum(impl: str, steps: int) -> list[torch.Tensor]:
    """A few SGD steps with Adasum as `impl` (`native` or `plugin`); same model and data for both."""
    model = small_model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    aggregation.set_aggregation("adasum", adasum_impl=impl)
    try:
        opt = aggregation.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    finally:
        aggregation.set_aggregation(None)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert aggregation.aggregation_of(opt) == ("adasum:native" if impl == "native" else "adasum:plugin/allgather")
    return [p.detach().clone() for p in model.parameters()]


def weighted_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 10, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (96,), generator=gen)
    return x, y


def weighted_model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def late_sgd(late_at: int, delay: float) -> type:
    """SGD whose `late_at`-th update takes `delay` s longer on the last rank.

    Horovod rebuilds the optimizer as a subclass of its class from the param
    groups alone, so the delay lives in the class, not in constructor arguments.
    """
    class LateSGD(torch.optim.SGD):
        def step(self, *args, **kwargs):
            out = super().step(*args, **kwargs)
            self.updates = getattr(self, "updates", 0) + 1
            if self.updates == late_at and hvd.rank() == hvd.size() - 1:
                time.sleep(delay)
            return out
    return LateSGD


def train_weighted(rule: str, sizes: list[int], steps: int, lr: float, period: int = 10_000,
                   late: float = 0.0) -> list[list[float]]:
    x, y = weighted_dataset()
    model = weighted_model()
    aggregation.set_aggregation(rule)
    try:
        sampler = aggregation.batch_sampler(len(x), sum(sizes), seed=5, initial_sizes=sizes,
                                            lbbsp=dataclasses.replace(aggregation.settings().lbbsp, period=period))
        sgd = late_sgd(steps, late) if late > 0 else torch.optim.SGD
        opt = aggregation.DistributedOptimizer(sgd(model.parameters(), lr=lr, momentum=0.9),
                                               named_parameters=model.named_parameters())
    finally:
        aggregation.set_aggregation(None)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    done = 0
    while done < steps:
        for xb, yb in loader:
            assert period < steps or len(xb) == sizes[hvd.rank()]  # sizes change only at a period
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["adasum", "weighted", "late-share"])
    p.add_argument("--native", action="store_true")
    p.add_argument("--process-set", default="")
    p.add_argument("--cases", type=int, default=3)
    p.add_argument("--sizes", default="5,11,16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--late", type=float, default=2.0, help="late-share: the last rank's extra seconds")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    members = [int(r) for r in args.process_set.split(",")] if args.process_set else []
    pset = hvd.ProcessSet(members) if members else None
    hvd.init(process_sets=[pset] if pset is not None else None)
    torch.set_num_threads(1)
    summary: dict = {"rank": hvd.rank(), "size": hvd.size(), "mpi_enabled": hvd.mpi_enabled()}
    if args.mode == "adasum":
        summary["checks"] = check_plugin(list(range(hvd.size())), None, "global", args.cases)
        if pset is not None:
            if pset.included():
                summary["checks"].update(check_plugin(members, pset, "process_set", args.cases))
            hvd.barrier()  # ranks outside the set wait here, not in shutdown
        if args.native:
            summary["checks"].update(check_native(args.cases))
            native = train_adasum("native", args.steps)
            plugin = train_adasum("plugin", args.steps)
            summary["optimizer_plugin_vs_native"] = max(rel_err(a, b) for a, b in zip(plugin, native))
            summary["optimizer_moved"] = max(rel_err(b, a) for a, b in zip(small_model(7).parameters(), native))
    elif args.mode == "late-share":
        sizes = [int(s) for s in args.sizes.split(",")]
        # period 2, an even step count: the last step starts a share that nothing reads
        summary["weighted"] = train_weighted("weighted", sizes, args.steps, 0.1, period=2, late=args.late)
        summary["shutdown_at"] = time.time()
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
        summary["sizes"] = sizes
        summary["weighted"] = train_weighted("weighted", sizes, args.steps, 0.1)
        summary["average"] = train_weighted("average", sizes, args.steps, 0.1)
    write_rank_summary(args.out, hvd.rank(), summary)
    hvd.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
