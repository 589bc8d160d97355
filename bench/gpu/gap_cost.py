"""What a neighbour's compute costs the GPU steps inside a production job's allreduce.

`bench.gpu --only gapcost` (about a minute of GPU time). On a GPU whose jobs
run Horovod without NCCL, an allreduce is not all network: each gradient goes
to host memory before the ring and comes back after it, and Horovod copies it
back tensor by tensor on its background thread, waiting for each copy before
it runs the next response's ring. The priority classes put a low job's compute
into that allreduce. This check measures what that costs the production side's
GPU steps alone, without a network or a daemon:

  probe      one process, standing in for the production rank: the gradients
             of `--model` (their real shapes) on the GPU and in pinned host
             memory. Each round, spaced by idle time as a ring's wait would be,
             it times four steps: `h2d_each`, the copies back one by one, each
             waited for (Horovod's callbacks); `h2d_batched`, the same copies
             queued and waited for once; `d2h`, the copies out with one event
             (Horovod's staging before the ring); `kernel`, one small kernel
             launched and waited for (what one turn of the GPU costs it).
  neighbour  another process training `--model` on `--batch` images beside it,
             as a low job's compute phase does: `free` (its CPU queues as far
             ahead as it likes) or `paced` (at most two layers queued, as the
             plugin bounds an outranked rank: `RunAhead`).

Conditions, in one run: alone, beside a free neighbour, beside a paced one
(and each as MPS clients with --mps). If `h2d_each` grows by tens of ms beside
a neighbour while `h2d_batched` grows by one turn, the production job's loss
is Horovod's one-by-one copy back, and staging the copies back in one batch
(in the production rank's next compute phase) is what removes it.

`--dry-run` runs the same processes on the CPU (copies are memory copies, and
no paced neighbour: pacing bounds a CUDA queue): it checks the plumbing, and its
figures are CPU figures.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["CONDITIONS", "STEPS", "check_gap_cost", "judge", "table"]

CONDITIONS = ("alone", "free", "paced")
STEPS = ("h2d_each", "h2d_batched", "d2h", "kernel")
_KERNEL_REPEATS = 5


def _model(cfg: dict[str, Any]) -> Any:
    from testbed.workloads.vision import import_torchvision

    return getattr(import_torchvision().models, cfg["model"])(num_classes=cfg["classes"])


def _neighbour(cfg: dict[str, Any], paced: bool, conn: Connection) -> None:
    """Train the model until told to stop; say "warm" after a few iterations, then the iteration count."""
    import torch
    import torch.nn as nn

    try:
        device = torch.device("cpu" if cfg["dry_run"] else "cuda")
        torch.set_num_threads(2)
        model = _model(cfg).to(device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        if paced and device.type == "cuda":
            from crossover.plugins.hook.cuda_turns import RunAhead

            run_ahead = RunAhead(depth=2)
            for module in model.modules():
                if not list(module.children()):
                    module.register_forward_pre_hook(lambda *_: run_ahead())
            for p in model.parameters():
                p.register_hook(lambda _grad: run_ahead())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(cfg["batch"], 3, cfg["image_size"], cfg["image_size"], device=device)
        y = torch.randint(0, cfg["classes"], (cfg["batch"],), device=device)
        iters, t_warm = 0, 0.0
        while not conn.poll():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            iters += 1
            if iters == 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t_warm = time.monotonic()
                conn.send("warm")
        if device.type == "cuda":
            torch.cuda.synchronize()
        conn.send({"iters_per_s": (iters - 3) / max(1e-9, time.monotonic() - t_warm) if t_warm else 0.0})
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _probe(cfg: dict[str, Any], conn: Connection) -> None:
    """The production side: on each "round N" message, N timed rounds of every step; then their times (ms)."""
    import torch

    try:
        cuda = not cfg["dry_run"]
        shapes = [p.shape for p in _model(cfg).parameters()]
        gpu = [torch.zeros(s, device="cuda" if cuda else "cpu") for s in shapes]
        host = [torch.ones(s, pin_memory=cuda) for s in shapes]
        small = torch.zeros(1024, device=gpu[0].device)

        def sync() -> None:
            if cuda:
                torch.cuda.current_stream().synchronize()

        def h2d_each() -> None:
            for g, h in zip(gpu, host):
                g.copy_(h)
                sync()

        def h2d_batched() -> None:
            for g, h in zip(gpu, host):
                g.copy_(h, non_blocking=cuda)
            sync()

        def d2h() -> None:
            for g, h in zip(gpu, host):
                h.copy_(g, non_blocking=cuda)
            sync()

        def kernel() -> None:
            small.add_(1.0)
            sync()

        steps = {"h2d_each": h2d_each, "h2d_batched": h2d_batched, "d2h": d2h, "kernel": kernel}
        for fn in steps.values():
            fn()
        conn.send({"bytes": sum(4 * h.numel() for h in host), "tensors": len(host)})
        while True:
            msg = conn.recv()
            if msg == "stop":
                return
            times: dict[str, list[float]] = {name: [] for name in steps}
            for _ in range(int(msg)):
                for name, fn in steps.items():
                    for _ in range(_KERNEL_REPEATS if name == "kernel" else 1):
                        time.sleep(cfg["idle_ms"] / 1000)
                        t = time.perf_counter()
                        fn()
                        times[name].append(1000 * (time.perf_counter() - t))
            conn.send(times)
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _recv(conn: Connection, timeout: float, who: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} said nothing in {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:  # the parent holds no copy of the child's end: its exit is an EOF at once
        raise RuntimeError(f"the {who} exited without a word") from None
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"the {who}: {msg['error']}")
    return msg


def _start(ctx: Any, procs: list[Any], target: Any, name: str, cfg: dict[str, Any], *extra: Any) -> Connection:
    """Start `target(cfg, *extra, conn)` in a spawned process; its pipe's other end, for the parent."""
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(cfg, *extra, theirs), daemon=True, name=name)
    proc.start()
    procs.append(proc)
    theirs.close()
    return mine


def judge(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Each step's median per condition (ms), and each condition's added ms over `alone`."""
    medians = {cond: {step: round(statistics.median(v), 3) for step, v in steps.items() if v}
               for cond, steps in times.items()}
    base = medians.get("alone", {})
    added = {cond: {step: round(m - base[step], 3) for step, m in steps.items() if step in base}
             for cond, steps in medians.items() if cond != "alone"}
    return {"median_ms": medians, "added_ms": added}


def check_gap_cost(args: argparse.Namespace, workdir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Time the probe's steps alone and beside each neighbour, in one run; `env`: extra (MPS) environment."""
    cfg = {"dry_run": args.dry_run, "model": args.model, "classes": args.classes, "batch": args.batch,
           "image_size": args.image_size, "idle_ms": args.gap_idle_ms}
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # spawned children inherit it (the MPS pipe folder)
    try:
        return _run(args, cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    procs: list[Any] = []  # every child, killed on the way out whatever happened
    times: dict[str, dict[str, list[float]]] = {}
    rates: dict[str, float] = {}
    try:
        probe = _start(ctx, procs, _probe, "gapcost-probe", cfg)
        shape = _recv(probe, 120, "probe")
        # Pacing bounds a CUDA queue: on the CPU a paced neighbour is a free one.
        for cond in CONDITIONS[:2] if cfg["dry_run"] else CONDITIONS:
            neighbour = None
            if cond != "alone":
                neighbour = _start(ctx, procs, _neighbour, f"gapcost-{cond}", cfg, cond == "paced")
                _recv(neighbour, 180, f"{cond} neighbour")
            probe.send(args.gap_rounds)
            times[cond] = _recv(probe, 300, "probe")
            if neighbour is not None:
                neighbour.send("stop")
                rates[cond] = round(_recv(neighbour, 60, f"{cond} neighbour")["iters_per_s"], 2)
                procs[-1].join(10.0)  # gone before the next condition's neighbour starts
        probe.send("stop")
    finally:
        for proc in procs:
            proc.join(5.0 if proc is procs[0] else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    return {**shape, "rounds": args.gap_rounds, "idle_ms": args.gap_idle_ms, "neighbour_iters_per_s": rates,
            **judge(times)}


def table(result: dict[str, Any]) -> str:
    """The medians as a text table: a row per condition, a column per step."""
    rows = [f"{'condition':<10}" + "".join(f"{s:>13}" for s in STEPS) + f"{'neighbour it/s':>16}"]
    for cond, steps in result["median_ms"].items():
        rows.append(f"{cond:<10}" + "".join(f"{steps.get(s, float('nan')):>13.3f}" for s in STEPS)
                    + f"{result['neighbour_iters_per_s'].get(cond, float('nan')):>16.2f}")
    return "\n".join(rows)
