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
import contextlib
import os
import time
from typing import Any

import torch
import torch.nn as nn

from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import timed_summary, write_rank_summary
from testbed.workloads.vision import import_torchvision


class _Horovod:
    """Horovod's side of the workload: init, the optimizer, a stand-in's allreduce of zeros, the uneven end."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, peer: bool) -> tuple[Any, Any]:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        self.zeros = [(q, torch.zeros_like(q)) for q in model.parameters()] if peer else []
        return model, opt

    def reduce_zeros(self, _forward: Any, opt: Any) -> None:
        for q, g in self.zeros:
            q.grad = g.zero_()
        opt.synchronize()  # allreduces every gradient; the stand-in's own copy is never updated

    def uneven(self, _forward: Any) -> Any:
        return contextlib.nullcontext()

    def finish(self) -> None:
        self.hvd.join()

    def shutdown(self) -> None:
        self.hvd.shutdown()


class _StandIn(nn.Module):
    """The peer's DDP module: the model's parameters, a forward that only touches each (zero gradients)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self) -> torch.Tensor:
        return torch.stack([(p.view(-1)[:1] * 0).sum() for p in self.model.parameters()]).sum()


class _DDP:
    """DDP's side: Gloo from torchrun's variables; a stand-in's backward gives DDP zero gradients to reduce."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, peer: bool) -> tuple[Any, Any]:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(_StandIn(model) if peer else model), opt  # broadcasts rank 0's parameters

    def reduce_zeros(self, forward: Any, _opt: Any) -> None:
        forward().backward()  # zero gradients, allreduced as the GPU rank's; the copy is never stepped

    def uneven(self, forward: Any) -> Any:
        from torch.distributed.algorithms.join import Join

        return Join([forward])

    def finish(self) -> None:
        pass

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="ddp: DistributedDataParallel over Gloo, started by torchrun")
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
    ranks = _DDP() if args.framework == "ddp" else _Horovod()
    peer = bool(args.peer_node) and os.environ.get("CROSSOVER_NODE") == args.peer_node
    device = torch.device("cpu" if args.cpu or peer else "cuda")
    torch.manual_seed(args.seed)
    model = getattr(import_torchvision().models, args.model)(num_classes=args.classes).to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    forward, opt = ranks.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), peer)

    gen = torch.Generator().manual_seed(args.seed + 1 + ranks.rank)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(device)

    starts, ends, losses = [], [], []
    with ranks.uneven(forward):
        for _ in range(args.iters):
            if args.stop_file and os.path.exists(args.stop_file):
                break
            t0 = time.monotonic()
            opt.zero_grad()
            if peer:
                time.sleep(max(0.0, args.peer_compute_ms / 1000 - (time.monotonic() - t0)))
                ranks.reduce_zeros(forward, opt)
                loss = 0.0
            else:
                out = nn.functional.cross_entropy(forward(x), y)
                out.backward()
                opt.step()
                loss = float(out.detach())
            ends.append(time.monotonic())
            starts.append(t0)
            losses.append(loss)

    ranks.finish()
    write_rank_summary(args.out, ranks.rank, timed_summary(model, args.batch, starts, ends, losses, rank=ranks.rank,
                                                           size=ranks.size, peer=peer, device=str(device),
                                                           model=args.model))
    ranks.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
