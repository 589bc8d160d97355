"""A plain FSDP (FullyShardedDataParallel) script for `torchrun` on CPU tensors with Gloo (no Crossover import).

Crossover does not track FSDP's phases: the test runs it with and without the import
and checks it trains the same and unscheduled. Each rank writes its shard's digest to --out.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from testbed.workloads.summary import model_digest, write_rank_summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.iters):
        opt.zero_grad()
        x = torch.randn(32, 16, generator=gen)
        nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
    write_rank_summary(args.out, dist.get_rank(), {"rank": dist.get_rank(), "digest": model_digest(model),
                                                   "pid": os.getpid()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
