"""A plain Horovod PyTorch training script (no Crossover import).

Tests and benchmarks run it as is, or with `import crossover.auto` prepended as
its first line, under a real `horovodrun`. Each rank writes a JSON summary
(parameter digest, per-iteration times) to --out.
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.stop_file import publish_progress, stop_before
from testbed.workloads.summary import model_digest, write_rank_summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--op", choices=["average", "sum", "adasum"], default="average")
    p.add_argument("--bpps", type=int, default=1, help="backward_passes_per_step")
    p.add_argument("--fp16", action="store_true", help="Compression.fp16")
    p.add_argument("--predivide", type=float, default=1.0)
    p.add_argument("--process-set", action="store_true", help="allreduce in a process set of ranks 0 and 1 only")
    p.add_argument("--manual-sync", action="store_true", help="synchronize(), clip, then step() under skip_synchronize")
    p.add_argument("--lr-schedule", action="store_true", help="a StepLR built on the distributed optimizer")
    p.add_argument("--metric", action="store_true",
                   help="average the loss over ranks with hvd.allreduce after every step (a metric, as "
                        "Horovod's ImageNet example does)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="")
    p.add_argument("--stop-file", default="",
                   help="stop before --iters once this file exists: before the iteration it names, or at once if "
                        "it is empty (one-rank jobs only: a larger job's ranks would stop at different steps). "
                        "Rank 0 writes how far it got to FILE.at every 10 iterations (`testbed.workloads.stop_file`)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    pset = hvd.ProcessSet([0, 1]) if args.process_set else None
    hvd.init(process_sets=[pset] if pset is not None else None)
    torch.manual_seed(args.seed)

    layers, d = [], 32
    for _ in range(args.depth):
        layers += [nn.Linear(d, args.width), nn.ReLU()]
        d = args.width
    layers.append(nn.Linear(d, 1))
    model = nn.Sequential(*layers)
    lr = 0.01 if args.op != "sum" else 0.01 / hvd.size()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    kwargs = dict(
        named_parameters=model.named_parameters(),
        op={"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[args.op],
        backward_passes_per_step=args.bpps,
        compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none,
        gradient_predivide_factor=args.predivide,
    )
    if pset is not None:
        kwargs["process_set"] = pset
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7) if args.lr_schedule else None

    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    times, loss = [], None
    for it in range(args.iters):
        if args.stop_file:
            if stop_before(args.stop_file, it):
                break
            if hvd.rank() == 0:
                publish_progress(args.stop_file, it)
        t0 = time.perf_counter()
        opt.zero_grad()
        for _ in range(args.bpps):
            x = torch.randn(args.batch, 32, generator=gen)
            y = x @ w_true + 0.1 * torch.randn(args.batch, 1, generator=gen)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if args.manual_sync:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        if args.metric:
            hvd.allreduce(loss.detach(), name="metric.loss")
        times.append(time.perf_counter() - t0)

    hvd.join()  # ranks outside a process set finish early; wait for the others before shutdown
    summary = {"rank": hvd.rank(), "size": hvd.size(), "digest": model_digest(model), "loss": float(loss.detach()),
               "iter_times": times, "pid": os.getpid()}
    write_rank_summary(args.out, hvd.rank(), summary)
    hvd.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
