"""A DDP job whose GPU memory is set in shares of the device: for the memory benchmark (`bench.gpu --only memory`).

It holds `--base` of the device from the start (frozen weights, a cache: a tensor
outside the module, which DDP neither broadcasts nor reduces), needs `--act` more during each iteration (activations,
freed at its end and kept cached by torch's allocator, as a real job's are), and
`--grow` more at each iteration, kept, up to `--target` (a job whose cache grows).
Once `--spike-file` exists it needs `--spike` more in one iteration (a longer batch,
an evaluation pass). Each iteration also runs `--work-ms` of matrix products on the
device, so two jobs contend for its time too.

On an emulated device (`EMULATED_DEVICE_SOCKET`, the CPU dry run) the same needs go
to the device model's memory (`testbed.device_model`), whose pool the plugin caps as
it caps torch's, and the work is the model's; `--total-mb` gives the device's size.

Rank 0 writes a JSON summary to `--out`: each iteration's start and end, the most it
held, and how it ended: `ok`, or `oom` with the iteration and the error's text (the
out-of-memory error is then raised again, so the job fails as it would). It writes its
progress to `OUT.progress` (`grown` once `--target` is reached) for the benchmark.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from testbed.device_model.client import DeviceClient
from testbed.device_model.turns import ModelTurns


class Job(nn.Module):
    """The trainable part: the device work of each iteration."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, repeat: int) -> torch.Tensor:
        for _ in range(repeat):
            x = torch.tanh(self.layer(x))
        return x


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=100_000)
    p.add_argument("--base", type=float, default=0.0, help="share of the device held from the start")
    p.add_argument("--act", type=float, default=0.0, help="share needed during each iteration")
    p.add_argument("--grow", type=float, default=0.0, help="share kept more at each iteration")
    p.add_argument("--target", type=float, default=0.0, help="where the growth stops (share)")
    p.add_argument("--spike", type=float, default=0.0, help="share needed more once --spike-file exists")
    p.add_argument("--spike-file", default="")
    p.add_argument("--stop-file", default="")
    p.add_argument("--work-ms", type=float, default=20.0, help="device work per iteration (about)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--total-mb", type=int, default=0, help="the emulated device's memory (MiB)")
    p.add_argument("--managed-alloc", default="", help="a shared library with xo_managed_malloc/xo_managed_free: "
                   "every CUDA allocation becomes managed memory, which can spill to the host")
    args = p.parse_args()
    if args.managed_alloc:  # before anything allocates on the device
        from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

        change_current_allocator(CUDAPluggableAllocator(args.managed_alloc, "xo_managed_malloc", "xo_managed_free"))

    emulated = DeviceClient.from_env()
    turns = None if emulated is None else ModelTurns(emulated)
    plugin = sys.modules.get("crossover.auto")
    if turns is not None and plugin is not None:
        from crossover.plugins.hook.rank_session import use_device

        use_device(turns)
    cuda = turns is None and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        total = torch.cuda.mem_get_info()[1]
    else:
        total = args.total_mb << 20
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    share = lambda f: int(f * total)  # noqa: E731
    width = args.width if cuda else 64
    held = torch.ones(share(args.base), dtype=torch.uint8, device=device) if cuda else None
    model = Job(width).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.layer.parameters(), lr=1e-3)
    x = torch.randn(256, width, device=device)
    repeat = 1
    if cuda:  # calibrate the device work per iteration once
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            ddp(x, 1)
        torch.cuda.synchronize()
        repeat = max(1, round(args.work_ms / ((time.perf_counter() - t) * 100)))

    out = Path(args.out)
    progress = out.with_suffix(".progress")
    kept: list[torch.Tensor] = []
    grown = 0
    starts, ends, peak = [], [], 0
    spiked = False
    result: dict[str, object] = {"outcome": "ok"}
    try:
        for i in range(args.iters):
            if args.stop_file and os.path.exists(args.stop_file):
                break
            t0 = time.monotonic()
            if grown < share(args.target):
                step = min(share(args.grow), share(args.target) - grown)
                if cuda:
                    kept.append(torch.ones(step, dtype=torch.uint8, device=device))
                grown += step
            need = share(args.base) + grown + share(args.act)
            spike = bool(args.spike_file) and not spiked and os.path.exists(args.spike_file)
            if spike:
                need += share(args.spike)
            opt.zero_grad()
            if turns is not None:
                turns.need(need)
                turns.client.compute(args.work_ms / 1000)
            extra = share(args.act) + (share(args.spike) if spike else 0)
            scratch = torch.ones(extra, dtype=torch.uint8, device=device) if cuda and extra else None
            ddp(x, repeat).sum().backward()
            opt.step()
            del scratch
            if cuda:
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_reserved())
            spiked = spiked or spike
            starts.append(t0)
            ends.append(time.monotonic())
            progress.write_text(f"{i + 1} {'grown' if grown >= share(args.target) else ''}")
    except torch.OutOfMemoryError as exc:
        result = {"outcome": "oom", "iteration": len(starts), "error": str(exc)[-2000:],
                  "notes": list(getattr(exc, "__notes__", []))}
        raise
    finally:
        if dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**result, "starts": starts, "ends": ends, "peak_reserved": peak,
                                       "spiked": spiked, "total": total}))
    del held
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
