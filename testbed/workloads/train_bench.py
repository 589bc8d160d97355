"""A data-parallel PyTorch classifier for benchmarks, under Horovod or DDP (no Crossover import).

An MLP (input -> depth x width -> classes, ReLU) trained with SGD + momentum on a
fixed synthetic classification set: inputs drawn once from a seeded Gaussian,
labels from a seeded random teacher network, each rank reading its own shard
in mini-batches. Parameter count (allreduce bytes) and batch size (compute)
are set independently, so a benchmark can pick comm:compute at a link rate.

On an emulated cluster with a device model (`EMULATED_DEVICE_SOCKET` set),
the compute phase runs on the node's emulated device: `--device-ms-per-sample`
x batch of device work, then the real forward and backward on only
`--real-batch` rows (so gradients, and the allreduce, stay real while compute
costs little CPU). The rank tells the device when its allreduce is in flight.
Under `import crossover.auto` the device is the plugin's
(`crossover.plugins.hook.rank_session.use_device`). With `--queue-device-work` the device work is
queued as a GPU's kernels are and the CPU goes on at once, so a rank can end
its turn before its device has done it (docs/handover.md); its gradients'
allreduce then overlaps that work from the start, which a GPU's overlaps only
from each gradient's readiness on: use it to compare hand-overs, not to
place a job's comm:compute ratio.

Each rank writes a JSON summary to --out: per-iteration start/end on
time.monotonic() (the clock the daemons' event logs use, shared by every
network namespace on the machine), losses, and the model's parameter count.

`--framework ddp` trains the same model on the same data with `DistributedDataParallel`
over Gloo, started by `torchrun` (`testbed.cluster`'s launcher starts one per node);
ranks that stop at different iterations are evened out by DDP's `Join`, as Horovod's
by `hvd.join()`. Its allreduce runs inside the backward, so the device model hears of it
from a callback at the backward's last node until the backward returns.
"""
import argparse
import contextlib
import os
import sys
import threading
import time

import torch
import torch.nn as nn

from testbed.device_model.client import DeviceClient
from testbed.device_model.turns import ModelTurns
from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import timed_summary, write_rank_summary


def build(in_dim: int, width: int, depth: int, classes: int) -> nn.Module:
    layers, d = [], in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


class _Horovod:
    """The Horovod side of the workload: init, the optimizer, the allreduce's end, the uneven end."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(opt, root_rank=0)
        return model, self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def comm_begins(self, opt, device: DeviceClient) -> None:
        device.comm(True)
        threading.Thread(target=_comm_done_when_allreduced, args=(opt, device), daemon=True).start()

    def comm_ends(self, device: DeviceClient) -> None:
        pass

    def uneven(self, model: nn.Module):
        return contextlib.nullcontext()

    def finish(self) -> None:
        self.hvd.join()  # with --stop-file the ranks may have done different numbers of steps
        self.hvd.shutdown()


class _DDP:
    """The DDP side: a Gloo process group from torchrun's variables, DDP's allreduce inside the backward."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), opt  # DDP broadcasts rank 0's parameters as it is built

    def comm_begins(self, opt, device: DeviceClient) -> None:
        pass  # told from the backward (`device_hears_of_allreduce`)

    def comm_ends(self, device: DeviceClient) -> None:
        device.comm(False)  # the backward has returned: DDP has waited for every bucket

    def uneven(self, model: nn.Module):
        from torch.distributed.algorithms.join import Join

        return Join([model])  # type: ignore[list-item]  # a DistributedDataParallel is Joinable

    def finish(self) -> None:
        self.dist.destroy_process_group()


def device_hears_of_allreduce(model: nn.Module, device: DeviceClient) -> None:
    """DDP: once a backward has run every node, its buckets' allreduces are in flight; tell the device then."""
    from torch.autograd import Variable

    def arm(_module, _args, output) -> None:
        if torch.is_grad_enabled() and output.grad_fn is not None:
            fired: list[int] = []

            def first(_grads):
                if not fired:
                    fired.append(1)
                    Variable._execution_engine.queue_callback(lambda: device.comm(True))

            output.grad_fn.register_prehook(first)

    model.register_forward_hook(arm)


def _comm_done_when_allreduced(opt, device: DeviceClient) -> None:
    """Tell the emulated device the allreduce is over when Horovod has finished it: not when `step()`
    returns, which is later by the wait for the next grant (no allreduce runs then)."""
    from horovod.torch.mpi_ops import poll

    handles = [h for h, _ in list(getattr(opt, "_handles", {}).values()) if isinstance(h, int)]
    for h in handles:
        try:
            while not poll(h):
                time.sleep(0.0005)
        except (RuntimeError, ValueError):  # already collected by synchronize(): done
            pass
    device.comm(False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="ddp: DistributedDataParallel over Gloo, started by torchrun")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batch", type=int, default=256, help="per-rank mini-batch")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--in-dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--samples", type=int, default=8192, help="training samples per rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stop-file", default="", help="stop (at an iteration boundary) once this file exists; "
                   "ranks may stop one iteration apart, hvd.join() evens that out")
    p.add_argument("--go-file", default="", help="wait for this file before hvd.init: the interpreter has "
                   "started but the job has not yet joined anything (a job arriving at a chosen moment)")
    p.add_argument("--device-ms-per-sample", type=float, default=0.0,
                   help="with an emulated device: its compute time per sample (ms)")
    p.add_argument("--device-in-backward", action="store_true",
                   help="run the device work inside the backward, a share of it before each parameter's "
                        "gradient, as a GPU's backward kernels run layer by layer: a rank that yields at a "
                        "gradient then hands its device over within one share, not after the whole phase")
    p.add_argument("--queue-device-work", action="store_true",
                   help="with an emulated device: queue the compute phase and go on (a GPU's launches), so a turn "
                        "can end before the device has done it; the allreduce is not held back for it")
    p.add_argument("--real-batch", type=int, default=8,
                   help="with an emulated device: rows of the batch really computed on the CPU")
    p.add_argument("--device-memory-mb", type=int, default=0,
                   help="with an emulated device: the memory (MiB) its allocator pool needs from the first iteration "
                        "(a model, its optimizer state, its activations); 0: memory is not modelled")
    p.add_argument("--device-memory-growth-mb", type=int, default=0,
                   help="what the pool needs more at each later iteration (a job that grows)")
    p.add_argument("--device-memory-max-mb", type=int, default=0, help="where the growth stops (0: it does not)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = DeviceClient.from_env()
    if args.device_in_backward and args.queue_device_work:
        p.error("--device-in-backward runs the device work as the backward reaches it; it cannot also be queued")
    if device is not None and args.device_ms_per_sample <= 0:
        p.error("an emulated device is set (EMULATED_DEVICE_SOCKET): give --device-ms-per-sample > 0")
    plugin = sys.modules.get("crossover.auto")
    turns = None if device is None else ModelTurns(device)
    if turns is not None and plugin is not None:
        from crossover.plugins.hook.rank_session import use_device

        use_device(turns)

    torch.set_num_threads(args.threads)
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.02)
    ranks = _DDP() if args.framework == "ddp" else _Horovod()
    torch.manual_seed(args.seed)
    network = build(args.in_dim, args.width, args.depth, args.classes)
    model, opt = ranks.wrap(network, torch.optim.SGD(network.parameters(), lr=0.01 * ranks.size, momentum=0.9))
    if device is not None and args.framework == "ddp":
        device_hears_of_allreduce(model, device)

    # The data set: the same teacher everywhere, a different shard per rank.
    teacher = build(args.in_dim, 64, 1, args.classes)
    gen = torch.Generator().manual_seed(args.seed + 1 + ranks.rank)
    with torch.no_grad():
        for t in teacher.parameters():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)))
        x_all = torch.randn(args.samples, args.in_dim, generator=gen)
        y_all = teacher(x_all).argmax(dim=1)

    work = args.batch * args.device_ms_per_sample / 1000  # an iteration's device work, the same in each
    if device is not None and args.device_in_backward:  # a share before each parameter's gradient
        params = list(network.parameters())
        for p_ in params:
            p_.register_hook(lambda g, share=work / len(params): device.compute(share))

    starts, ends, losses = [], [], []
    n_batches = max(1, args.samples // args.batch)
    with ranks.uneven(model):
        for i in range(args.iters):
            if args.stop_file and os.path.exists(args.stop_file):
                break
            t0 = time.monotonic()
            b = i % n_batches
            rows = args.batch if device is None else min(args.batch, args.real_batch)
            x, y = x_all[b * args.batch:b * args.batch + rows], y_all[b * args.batch:b * args.batch + rows]
            opt.zero_grad()
            if turns is not None and args.device_memory_mb:
                grown = args.device_memory_mb + i * args.device_memory_growth_mb
                turns.need(min(grown, args.device_memory_max_mb or grown) << 20)
            if device is not None and args.queue_device_work:
                device.submit(work)
            elif device is not None and not args.device_in_backward:
                device.compute(work)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if device is not None:
                if args.queue_device_work:
                    device.sync()
                ranks.comm_begins(opt, device)
                ranks.comm_ends(device)
            opt.step()
            ends.append(time.monotonic())
            starts.append(t0)
            losses.append(float(loss.detach()))

    write_rank_summary(args.out, ranks.rank, timed_summary(network, args.batch, starts, ends, losses,
                                                           rank=ranks.rank, size=ranks.size))
    ranks.finish()


if __name__ == "__main__":
    skip_final_collections()
    main()
