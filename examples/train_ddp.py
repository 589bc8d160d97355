import crossover.auto  # noqa: F401, I001  (first line: the one change Crossover asks of a script)

# A small DDP job for the README's quickstart: an MLP on synthetic data, launched with torchrun:
#
#     CROSSOVER_JOB_NAME=a torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 300
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4096, 64)
    y = (x @ torch.randn(64, 10, generator=torch.Generator().manual_seed(0))).argmax(dim=1)  # a learnable rule
    start = time.monotonic()
    for step in range(args.steps):
        batch = slice((step * 128) % 4096, (step * 128) % 4096 + 128)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    if dist.get_rank() == 0:
        print(f"{args.steps} steps in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
