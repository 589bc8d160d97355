"""Plugin overhead: one job (2 ranks by default), plain Horovod or DDP vs. the plugin under passthrough, exclusive.

Variants run interleaved, round after round and in a rotated order, so
machine noise and order effects hit all of them alike; the table reports the median over rounds of each variant's mean
iteration time, the overhead relative to the plain framework measured in the same
round, the acquire time (what a rank spends in `acquire` with nobody
contending, measured inside the ranks: under a lease no round trip, with
`--no-lease` the grant round trip), how many acquires ran under a lease,
and the daemon's CPU time
per rank-iteration (its user+system time from the job's start to its end:
the cost the node pays, less noisy than wall time on a saturated machine).

    python -m bench.overhead [--np 2] [--rounds 3] [--iters 80] [--target-ms 50] [--metric]
                             [--out results/overhead.json]
    python -m bench.overhead --hook-cost    # 1 rank, 160 parameter tensors, almost no compute
    python -m bench.overhead --hook-cost --daemon-cpus 1    # crossoverd on CPU 1, the job on the others
    python -m bench.overhead --hook-cost --framework ddp    # the same for a DDP job under torchrun (Gloo)

`--hook-cost` measures what the plugin adds per iteration where it shows most:
one rank (nothing to wait for), an MLP of 79 hidden layers of width 16 (160
parameter tensors, each with the plugin's gradient hook) and a batch of 8. The
table then gives each variant's added milliseconds per iteration against plain
Horovod of the same round, and the targets: at most 0.15 ms with a lease
(`exclusive`), 0.3 ms without one (`exclusive-no-lease`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.lib.jobs import WORKLOAD_OF, finish_job, start_job
from bench.lib.judge import mean, percentile
from bench.lib.results import machine, write_json
from crossover.settings import SettingError, parse_cpu_list
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import with_import

# exclusive: each rank is alone on its device, so it computes under a lease (no round trip per
# iteration); exclusive-no-lease (crossoverd --no-lease) measures the round trip every contended request pays,
# on the daemon's session socket (the default) and, in exclusive-no-lease-grpc, on the gRPC stream.
VARIANTS = ("plain", "passthrough", "exclusive", "exclusive-no-lease", "exclusive-no-lease-grpc")
HOOK_COST_TARGET_MS = {"exclusive": 0.15, "exclusive-no-lease": 0.3}  # added per iteration at 160 tensors


def run_variant(variant: str, workdir: Path, args: argparse.Namespace, rnd: int) -> dict:
    job_args = ["--iters", str(args.iters), "--width", str(args.width), "--batch", str(args.batch),
                "--depth", str(args.depth)]
    if args.metric:
        job_args += ["--pattern", "metric"] if args.framework == "ddp" else ["--metric"]
    name = f"{variant}{rnd}"
    workload = WORKLOAD_OF[args.framework]
    if variant == "plain":
        proc, out = start_job(name, workload, workdir, args.np, job_args, {}, args.framework)
        ranks = finish_job(proc, out)
        waits: list[float] = []
        leased = acquires = 0
        daemon_cpu_s = 0.0
    else:
        policy, _, options = variant.partition("-")
        flags = ["--no-lease"] if "no-lease" in options else []
        transport = {"CROSSOVER_TRANSPORT": "grpc"} if options.endswith("grpc") else {}
        with DaemonProc.in_dir(workdir, "--cpu-devices", "2", "--policy", policy, "--log-level", "WARNING", *flags,
                               name=name, nice=args.daemon_nice, cpus=args.daemon_cpus) as d:
            before = psutil.Process(d.pid).cpu_times()  # the daemon's own start-up is not the job's cost
            stats = workdir / f"{name}.stats.{{rank}}.json"
            # CROSSOVER_PIN=0: the plain job is not pinned either, so only the hook and RPC cost differ.
            proc, out = start_job(name, with_import(workdir, workload), workdir, args.np, job_args,
                                  {"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_STATS_FILE": str(stats),
                                   "CROSSOVER_PIN": "0", **transport}, args.framework)
            ranks = finish_job(proc, out)
            cpu = psutil.Process(d.pid).cpu_times()
            daemon_cpu_s = cpu.user + cpu.system - before.user - before.system
        waits = []
        leased = acquires = 0
        for r in range(args.np):
            s = json.loads(Path(str(stats).replace("{rank}", str(r))).read_text())
            assert s["attached"], f"{variant}: rank {r} ran unattached; the measurement would be meaningless"
            want = "grpc" if transport else "session socket"
            assert s["transport"] == want, f"{variant}: rank {r}'s stream went over {s['transport']}, not {want}"
            waits += s["grant_waits_s"][args.warmup:]
            leased += s["leased_acquires"]
            acquires += s.get("acquires", len(s["grant_waits_s"]))
    iters = [t for r in ranks for t in r["iter_times"][args.warmup:]]
    steps = sum(len(r["iter_times"]) for r in ranks)
    return {"iter_mean_s": mean(iters), "iter_p50_s": percentile(iters, 50), "grant_waits_s": waits,
            "leased_acquires": leased, "acquires": acquires,
            "daemon_cpu_ms_per_rank_iter": 1000 * daemon_cpu_s / max(steps, 1)}


def calibrate(workdir: Path, args: argparse.Namespace, progress: Progress) -> int:
    """The batch at which the plain job's iteration takes about ``--target-ms`` on this machine (time ∝ batch)."""
    task = progress.add_task(f"calibrating the batch for {args.target_ms:.0f} ms", total=2)
    batch = 192
    for attempt in range(2):
        probe = argparse.Namespace(**{**vars(args), "batch": batch, "iters": 40})
        measured = run_variant("plain", workdir, probe, 100 + attempt)["iter_mean_s"] * 1000
        batch = max(8, round(batch * args.target_ms / measured))
        progress.advance(task)
    progress.remove_task(task)
    return batch


def _cpu_list(text: str) -> frozenset[int]:
    """`1`, `0,2` or `2-3` as a set of CPU numbers (the kernel's cpu-list format)."""
    try:
        cpus = frozenset(parse_cpu_list(text))
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU")
    return cpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="the job: a Horovod MLP under horovodrun, or the same MLP under DDP and torchrun (Gloo, "
                        "the digits); each against its own framework without the plugin")
    p.add_argument("--np", type=int, default=2,
                   help="ranks of the job; on a 2-core machine 2 ranks fill every core, so the daemon's and the "
                        "RPC threads' CPU preempts a rank and stalls both (1 rank leaves them a core)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 5 with --hook-cost)")
    p.add_argument("--metric", action="store_true",
                   help="the workload averages its loss with hvd.allreduce after every step (Horovod's ImageNet "
                        "example does): a holder frees its device for that wait and asks again, so the no-lease "
                        "variants pay one more grant round trip per iteration")
    p.add_argument("--iters", type=int, default=None, help="iterations per job (default 80; 300 with --hook-cost)")
    p.add_argument("--warmup", type=int, default=None, help="iterations left out of the means (default 10; 30 "
                                                             "with --hook-cost)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3, help="hidden layers (2 x (depth + 1) parameter tensors)")
    p.add_argument("--hook-cost", action="store_true",
                   help="1 rank, depth 79 x width 16 (160 tensors), batch 8, 300 iterations, 5 rounds (unless "
                        "--iters or --rounds say otherwise): the "
                        "per-iteration cost of the hooks and the grant path, against the targets")
    p.add_argument("--batch", type=int, default=0,
                   help="per-rank batch; 0 (default): calibrated so the plain job takes --target-ms per iteration")
    p.add_argument("--target-ms", type=float, default=50.0, help="iteration time the calibration aims at")
    p.add_argument("--daemon-nice", type=int, default=0,
                   help="run crossoverd at this nice value (negative: ahead of the ranks when it wakes; needs root)")
    p.add_argument("--daemon-cpus", type=_cpu_list, default=frozenset(),
                   help="run crossoverd on these CPUs (e.g. 1 or 2-3) and the jobs on the others, as a node "
                        "that keeps a core for its services does; default: both share every CPU")
    p.add_argument("--out", type=Path, default=Path("results/overhead.json"))
    args = p.parse_args()
    if args.daemon_cpus:
        others = os.sched_getaffinity(0) - args.daemon_cpus
        if not others or not args.daemon_cpus <= os.sched_getaffinity(0):
            p.error(f"--daemon-cpus {sorted(args.daemon_cpus)}: must be some of this process's CPUs "
                    f"{sorted(os.sched_getaffinity(0))}, leaving at least one for the jobs")
        os.sched_setaffinity(0, others)  # horovodrun and its ranks inherit it
    if args.hook_cost:
        args.np, args.depth, args.width, args.batch = 1, 79, 16, 8
    for name, default, hook_cost in (("rounds", 3, 5), ("iters", 80, 300), ("warmup", 10, 30)):
        if getattr(args, name) is None:  # what the command line gives wins, --hook-cost or not
            setattr(args, name, hook_cost if args.hook_cost else default)

    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="xo-overhead-") as tmp, Progress(transient=True) as progress:
        if args.batch <= 0:
            args.batch = calibrate(Path(tmp), args, progress)
        task = progress.add_task("overhead", total=args.rounds * len(VARIANTS))
        for rnd in range(args.rounds):
            res = {}
            # Each round starts with a different variant, so none always runs right after the same one.
            for v in VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]:
                progress.update(task, description=f"round {rnd + 1}/{args.rounds}: {v}")
                res[v] = run_variant(v, Path(tmp), args, rnd)
                progress.advance(task)
            rounds.append(res)

    summary = {}
    for v in VARIANTS:
        means = [r[v]["iter_mean_s"] for r in rounds]
        rel = [r[v]["iter_mean_s"] / r["plain"]["iter_mean_s"] - 1 for r in rounds]
        waits = [w for r in rounds for w in r[v]["grant_waits_s"]]
        added = [1000 * (r[v]["iter_mean_s"] - r["plain"]["iter_mean_s"]) for r in rounds]
        summary[v] = {"iter_ms_median": 1000 * statistics.median(means),
                      "added_ms_median": statistics.median(added), "added_ms_rounds": added,
                      "target_added_ms": HOOK_COST_TARGET_MS.get(v) if args.hook_cost else None,
                      "overhead_pct_median": 100 * statistics.median(rel),
                      "overhead_pct_rounds": [100 * x for x in rel],
                      "grant_rtt_p50_ms": 1000 * percentile(waits, 50) if waits else None,
                      "grant_rtt_p99_ms": 1000 * percentile(waits, 99) if waits else None, "grants": len(waits),
                      "leased_acquires": sum(r[v]["leased_acquires"] for r in rounds),
                      "acquires": sum(r[v]["acquires"] for r in rounds),
                      "daemon_cpu_ms_per_rank_iter": statistics.median(
                          r[v]["daemon_cpu_ms_per_rank_iter"] for r in rounds)}

    t = Table(title=f"plugin overhead: 1 {args.framework} job x {args.np} ranks, batch {args.batch}, "
                    f"{2 * (args.depth + 1)} parameter "
                    f"tensors, {args.rounds} interleaved rounds, {args.iters} iters")
    for c in ("variant", "iter ms (median)", "overhead vs plain", "per round", "added ms", "target", "acquire p50 ms",
              "p99 ms",
              "leased", "daemon CPU ms / rank-iter"):
        t.add_column(c, justify="right")
    for v, s in summary.items():
        t.add_row(v, f"{s['iter_ms_median']:.2f}", f"{s['overhead_pct_median']:+.2f}%",
                  " ".join(f"{x:+.1f}" for x in s["overhead_pct_rounds"]),
                  "-" if v == "plain" else f"{s['added_ms_median']:+.3f}",
                  "-" if s["target_added_ms"] is None else
                  f"≤ {s['target_added_ms']:g}: {'met' if s['added_ms_median'] <= s['target_added_ms'] else 'MISSED'}",
                  "-" if s["grant_rtt_p50_ms"] is None else f"{s['grant_rtt_p50_ms']:.3f}",
                  "-" if s["grant_rtt_p99_ms"] is None else f"{s['grant_rtt_p99_ms']:.3f}",
                  f"{s['leased_acquires']}/{s['acquires']}" if s["acquires"] else "-",
                  "-" if v == "plain" else f"{s['daemon_cpu_ms_per_rank_iter']:.3f}")
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    per_round = [{v: {k: x for k, x in r[v].items() if k != "grant_waits_s"} for v in r} for r in rounds]
    write_json(args.out, {"benchmark": "overhead", "framework": args.framework, "time": time.time(),
                          "machine": machine(),
                          "args": {**vars(args), "out": str(args.out), "daemon_cpus": sorted(args.daemon_cpus)},
                          "summary": summary, "rounds": per_round})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
