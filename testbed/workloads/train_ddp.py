"""A plain PyTorch DDP training script for `torchrun` (no Crossover import), on scikit-learn's digits.

Tests and benchmarks run it as is, or with `import crossover.auto` prepended as its
first line, under a real `torchrun` with Gloo. `--pattern` picks one of the ways
people write DDP scripts (the patterns of issue 53); each rank writes a JSON summary
(parameter digest, per-iteration times, loss) to --out.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from testbed.workloads.digits import load_digits
from testbed.workloads.stop_file import publish_progress, stop_before
from testbed.workloads.summary import model_digest, write_rank_summary

PATTERNS = ("plain", "no_sync", "find_unused", "static_graph", "bucket_view", "fp16_hook", "zero", "compile",
            "checkpoint", "metric")


class Net(nn.Module):
    """An MLP on the 64 pixels; `spare` is a head no loss uses (find_unused_parameters' reason to exist)."""

    def __init__(self, width: int, depth: int, spare: bool) -> None:
        super().__init__()
        layers, d = [], 64
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, 10)
        self.spare = nn.Linear(d, 10) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pattern", choices=PATTERNS, default="plain")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--accum", type=int, default=2, help="no_sync: micro-batches per step")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fail-once-at", type=int, default=-1,
                   help="rank 1 exits with 3 before this iteration in the first attempt (TORCHELASTIC_RESTART_COUNT "
                        "0): torchrun --max-restarts then starts the workers again")
    p.add_argument("--no-destroy", action="store_true", help="leave the process group to the interpreter's exit")
    p.add_argument("--out", default="")
    p.add_argument("--stop-file", default="", help="stop early (`testbed.workloads.stop_file`)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    if args.fail_once_at >= 0:
        # torch's agent keeps one store across restarts, and Gloo's keys in it carry no attempt: a restarted
        # worker may read the failed attempt's addresses and never connect (1 run in 3 here, without
        # Crossover). One prefix per attempt keeps them apart.
        env = os.environ
        agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False)
        store = dist.PrefixStore(f"attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
        dist.init_process_group("gloo", store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    pixels, labels = load_digits()
    data = TensorDataset(torch.tensor(pixels / 16.0, dtype=torch.float32), torch.tensor(labels))
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers, drop_last=True,
                        persistent_workers=args.workers > 0)

    net = Net(args.width, args.depth, spare=args.pattern == "find_unused")
    model = DDP(net, find_unused_parameters=args.pattern == "find_unused",
                static_graph=args.pattern == "static_graph",
                gradient_as_bucket_view=args.pattern == "bucket_view")
    if args.pattern == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt: torch.optim.Optimizer
    if args.pattern == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forward = torch.compile(model, backend="aot_eager") if args.pattern == "compile" else model
    micro = args.accum if args.pattern == "no_sync" else 1

    times, loss, it, epoch = [], torch.zeros(()), 0, 0
    ckpt = os.path.join(args.out or ".", f"ckpt_{os.getpid()}.pt")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    while it < args.iters:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while it < args.iters:
            chunk = [b for b in (next(batches, None) for _ in range(micro)) if b is not None]
            if len(chunk) < micro:
                break
            if args.stop_file:
                if stop_before(args.stop_file, it):
                    args.iters = it
                    break
                if rank == 0:
                    publish_progress(args.stop_file, it)
            if it == args.fail_once_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(3)
            t0 = time.perf_counter()
            opt.zero_grad()
            for k, (x, y) in enumerate(chunk):
                if k < micro - 1:
                    with model.no_sync():
                        nn.functional.cross_entropy(forward(x), y).backward()
                else:
                    loss = nn.functional.cross_entropy(forward(x), y)
                    loss.backward()
            opt.step()
            if args.pattern == "metric":
                metric = loss.detach().clone()
                dist.all_reduce(metric)
            if args.pattern == "checkpoint" and it % 10 == 9:
                if rank == 0:
                    torch.save(net.state_dict(), ckpt)
                dist.barrier()
            times.append(time.perf_counter() - t0)
            it += 1
        epoch += 1
    if args.pattern == "checkpoint" and rank == 0 and os.path.exists(ckpt):
        os.remove(ckpt)
    write_rank_summary(args.out, rank, {"rank": rank, "size": size, "digest": model_digest(net),
                                        "loss": float(loss.detach()), "iter_times": times, "pid": os.getpid(),
                                        "pattern": args.pattern})
    if not args.no_destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
