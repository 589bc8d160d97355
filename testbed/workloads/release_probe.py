"""One rank whose last gradient leaves the GPU busy for a known time, for `bench.gpu`'s release check.

A hook on the first layer's weight gradient (the last one backward computes)
queues `torch.cuda._sleep` on the stream and notes when it did: the CPU then
reaches the end of backward long before the device does. A plugin that
released its grant when the CPU is done would release `--sleep-ms` early; one
that waits for the device's work (a CUDA event) releases after it. The daemon's
event log says which; this writes the launch times and the sleep's measured
length to --out.
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import write_rank_summary


def _cycles_for(ms: float) -> tuple[int, float]:
    """`torch.cuda._sleep` cycles for about `ms` on this GPU, and their measured length in seconds."""
    probe = 10_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm up the kernel
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    cycles = int(probe * ms / a.elapsed_time(b))
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles, a.elapsed_time(b) / 1000


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--sleep-ms", type=float, default=200.0)
    p.add_argument("--out", default="")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, 10)).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cycles, sleep_s = _cycles_for(args.sleep_ms)
    launched: list[float] = []

    def slow(grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(cycles)
        launched.append(time.monotonic())
        return grad

    model[0].weight.register_hook(slow)
    x = torch.randn(32, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    ends = []
    for _ in range(args.iters):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()
        ends.append(time.monotonic())
    write_rank_summary(args.out, hvd.rank(), {"rank": hvd.rank(), "pid": os.getpid(), "sleep_s": sleep_s,
                                              "cycles": cycles, "launched": launched, "iter_end": ends})
    hvd.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
