"""A torchvision ResNet on synthetic images, data-parallel under Horovod or DDP, for `bench.gpu` (no Crossover import).

On the GPU node each rank trains the real model on its device: forward,
backward and SGD with momentum on a fixed batch of random images. On the peer
node (`--peer-node`, matched against `CROSSOVER_NODE`), a rank stands in for
the other node of a two-node job: it holds the same parameters on the CPU,
waits `--peer-compute-ms` (the model's compute time alone on the GPU,
measured by the benchmark's calibration) and allreduces zero gradients of the
same names and shapes. Its optimizer never updates its copy: only the GPU
rank's model is trained, and the GPU sees exactly one node's share of a
two-node job, comm phases included.

`--framework ddp` runs the same under `DistributedDataParallel` over Gloo (started by
`torchrun`; NCCL cannot pair a GPU rank with a CPU stand-in): the stand-in wraps the model
on the CPU in a module whose forward costs nothing and whose backward gives every
parameter a zero gradient, so DDP allreduces the same buckets.

Each rank writes the JSON summary of `testbed/workloads/train_bench.py` to --out.
"""
import argparse
import os
import time

import torch
import torch.nn as nn

from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import timed_summary, write_rank_summary
from testbed.workloads.vision import import_torchvision


class _StandIn(nn.Module):
    """The peer's DDP module: the model's parameters, a forward that only touches each (zero gradients)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self) -> torch.Tensor:
        return torch.stack([(p.view(-1)[:1] * 0).sum() for p in self.model.parameters()]).sum()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    p.add_argument("--model", default="resnet18", help="a torchvision.models constructor")
    p.add_argument("--batch", type=int, default=128, help="per-rank mini-batch")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (the benchmark's dry run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-node", default="", help="ranks on this node (CROSSOVER_NODE) are stand-ins")
    p.add_argument("--peer-compute-ms", type=float, default=0.0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    if args.framework == "ddp":
        ddp_main(args)
        return
    import horovod.torch as hvd

    hvd.init()
    peer = bool(args.peer_node) and os.environ.get("CROSSOVER_NODE") == args.peer_node
    device = torch.device("cpu" if args.cpu or peer else "cuda")
    torch.manual_seed(args.seed)
    model = getattr(import_torchvision().models, args.model)(num_classes=args.classes).to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    gen = torch.Generator().manual_seed(args.seed + 1 + hvd.rank())
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(device)
    params = list(model.parameters())
    zeros = [torch.zeros_like(q) for q in params] if peer else []

    starts, ends, losses = [], [], []
    for _ in range(args.iters):
        if args.stop_file and os.path.exists(args.stop_file):
            break
        t0 = time.monotonic()
        if peer:
            opt.zero_grad()
            for q, g in zip(params, zeros):
                q.grad = g.zero_()
            time.sleep(max(0.0, args.peer_compute_ms / 1000 - (time.monotonic() - t0)))
            opt.synchronize()  # allreduces every gradient; the stand-in's own copy is never updated
            loss = 0.0
        else:
            opt.zero_grad()
            out = nn.functional.cross_entropy(model(x), y)
            out.backward()
            opt.step()
            loss = float(out.detach())
        ends.append(time.monotonic())
        starts.append(t0)
        losses.append(loss)

    hvd.join()
    write_rank_summary(args.out, hvd.rank(), timed_summary(model, args.batch, starts, ends, losses, peer=peer,
                                                           device=str(device), model=args.model))
    hvd.shutdown()


def ddp_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    peer = bool(args.peer_node) and os.environ.get("CROSSOVER_NODE") == args.peer_node
    device = torch.device("cpu" if args.cpu or peer else "cuda")
    torch.manual_seed(args.seed)
    model = getattr(import_torchvision().models, args.model)(num_classes=args.classes).to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    ddp = DistributedDataParallel(_StandIn(model) if peer else model)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(device)

    from torch.distributed.algorithms.join import Join

    starts, ends, losses = [], [], []
    with Join([ddp]):
        for _ in range(args.iters):
            if args.stop_file and os.path.exists(args.stop_file):
                break
            t0 = time.monotonic()
            opt.zero_grad()
            if peer:
                time.sleep(max(0.0, args.peer_compute_ms / 1000 - (time.monotonic() - t0)))
                ddp().backward()  # zero gradients, allreduced as the GPU rank's; the copy is never stepped
                loss = 0.0
            else:
                out = nn.functional.cross_entropy(ddp(x), y)
                out.backward()
                opt.step()
                loss = float(out.detach())
            ends.append(time.monotonic())
            starts.append(t0)
            losses.append(loss)
    write_rank_summary(args.out, rank, timed_summary(model, args.batch, starts, ends, losses, rank=rank, size=size,
                                                     peer=peer, device=str(device), model=args.model))
    dist.destroy_process_group()


if __name__ == "__main__":
    skip_final_collections()
    main()
