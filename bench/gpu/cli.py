"""Crossover on a real GPU: the daemon's NVML inventory, the CUDA release path, and co-located ResNet jobs.

One call on a bare GPU machine (`bench/gpu.sh` installs what is missing first)
runs five checks and writes `gpu.json` and `gpu_timeline.png` under --out:

  handover   two processes take turns on the GPU; the GPU's idle time at each
             hand-over, today's path (grant, launch, wait for the device,
             release) against two the GPU performs itself (stream memory
             operations on a shared page, interprocess events), whether a
             posted wait slows the holder, and what a SIGKILLed holder does to
             its waiter (`bench.gpu.handover`).
  inventory  a crossoverd without --cpu-devices: the GPUs NVML reports, as
             `crossover queue --json` shows them.
  gapcost    what a neighbour's compute costs the GPU steps inside a production
             job's host-staged allreduce: gradient copies back one by one (as
             Horovod without NCCL does) and in one batch, copies out, one small
             kernel; alone and beside a training neighbour (`bench.gpu.gap_cost`).
  release    a one-rank job whose last gradient leaves `--sleep-ms` of work
             queued on the GPU (testbed/workloads/release_probe.py): every grant
             must be released only after that work is done, as the daemon's
             event log records it.
  speedup    --jobs (2) jobs of a torchvision ResNet on synthetic images share the
             GPU. Each is a two-node job on an emulated cluster
             (`testbed.cluster`, network namespaces): node 0's daemon schedules
             the real GPU and runs each job's rank 0; node 1 stands in for the
             other node (testbed/workloads/train_gpu.py, a rank that waits the
             compute time measured alone and allreduces gradients of the same
             shapes), behind a tc-shaped link. So the GPU sees what one node
             of a two-node job sees: its compute phases and real allreduces
             (Horovod over Gloo, gradients staged through host memory).
             A calibration picks the link rate for the wanted comm:compute;
             then the jobs train while the daemons cycle through unscheduled
             (passthrough), exclusive (FIFO) and crossover, interleaved; one
             job alone afterwards gives the sequential figure and the bound.
             Judged by `bench.emulated.judge`, as the CPU bed is.

    bench/gpu.sh                       # on the GPU machine: set-up, then this
    bench/gpu.sh --only speedup --mps  # the same jobs as clients of an MPS daemon of the run's own
    python -m bench.gpu --dry-run      # the same steps on the CPU, small and short (CI)

Why a stand-in peer and not two ranks on the GPU: two ranks of one job on one
GPU would put both halves of every allreduce on the same device and node, which
no multi-node job sees; a second GPU is not there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from bench.emulated.cli import ClusterAdmin, job_ids, solo_result, wait_warm
from bench.emulated.judge import phase_medians, summarize
from bench.emulated.report import plot_timeline
from bench.emulated.scenarios import ADAPTS, CLASSES, CPU_HANDOVER, DSCP, POLICY, Scenario, settle_s
from bench.gpu.memory import check_memory
from bench.lib.mps import MpsDaemon
from bench.lib.results import git_commit, machine, write_json
from crossover.protos.event_file import EventName, read_events
from testbed import checkout_on_path
from testbed.cluster import Cluster, ClusterSpec, Link, Unsupported, preflight
from testbed.harness.daemon import kill_group, queue_state
from testbed.harness.jobs import WORKLOADS, rank_summaries, with_import

MODES = ("unscheduled", "exclusive", "crossover", "crossover-cpu")  # crossover-cpu: every turn ends on the CPU
PRIORITY_MODES = ("unscheduled", "crossover", "classes", "classes-dscp")  # --priority: job0 production, the others low
# --priority --adaptive adds classes-adaptive: classes, each device keeping grants only if they pay job0


def _log(msg: str) -> None:
    print(f"[bench.gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict[str, Any]:
    """What the machine offers: torch and CUDA, the GPU, Horovod's build, namespaces."""
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "commit": git_commit(), **machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_sms=props.multi_processor_count)
    try:
        import horovod
        import horovod.torch as hvd

        env.update(horovod=horovod.__version__, horovod_gloo=hvd.gloo_built(), horovod_nccl=hvd.nccl_built(),
                   horovod_cuda=hvd.cuda_built())
    except ImportError as exc:
        env["horovod"] = f"missing: {exc}"
    env["netns_preflight"] = preflight() or "ok"
    return env


# ---- a daemon of our own, outside any namespace ---------------------------------------------------------


class _Daemon:
    """`python -m crossover.daemon.main` on a socket in `workdir`; stopped on exit."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.socket, self.events = workdir / "d.sock", workdir / "d.events.jsonl"
        self.log = workdir / "d.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "crossover.daemon.main", "--socket", str(self.socket),
                 "--event-log", str(self.events), "--log-level", "INFO", "--no-adapt", *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": checkout_on_path(os.environ)})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"crossoverd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                self.queue = queue_state(self.socket, timeout=2)
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"crossoverd did not answer in 30 s: {self.log.read_text()[-2000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
                self.proc.wait()

    def __enter__(self) -> _Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_args(dry_run: bool) -> list[str]:
    return ["--cpu-devices", "1"] if dry_run else []


def check_inventory(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The devices a daemon without --cpu-devices finds (NVML), as its queue reports them."""
    with _Daemon(workdir, *_device_args(args.dry_run)) as d:
        devices = d.queue.get("devices", [])
    if not args.dry_run and not any(dev.get("kind") == "gpu" for dev in devices):
        raise RuntimeError(f"the daemon found no GPU through NVML: {devices}")
    return {"devices": devices}


def check_handover(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The idle GPU time of a hand-over, today's path against the GPU's own (`bench.gpu.handover`)."""
    from bench.gpu import handover as gpu_handover

    result = gpu_handover.check_handover(args, workdir, _Daemon, _device_args(args.dry_run))
    print(gpu_handover.table(result), flush=True)
    return result


def check_gap_cost(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """What a neighbour's compute costs a host-staged allreduce's GPU steps (`bench.gpu.gap_cost`)."""
    from bench.gpu import gap_cost

    with _mps_env(args, workdir) as env:
        result = gap_cost.check_gap_cost(args, workdir, env)
    if args.mps:
        result["mps"] = True
    print(gap_cost.table(result), flush=True)
    return result


@contextlib.contextmanager
def _mps_env(args: argparse.Namespace, workdir: Path) -> Iterator[dict[str, str]]:
    """With --mps, an MPS control daemon of this run's own for the block, and the environment its clients
    need; without, nothing and `{}`."""
    if not args.mps:
        yield {}
        return
    if args.dry_run:
        raise RuntimeError("--mps needs a GPU and NVIDIA's nvidia-cuda-mps-control")
    with MpsDaemon(workdir) as mps:
        yield mps.env()


def check_release(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Each grant's release against the end of the GPU work its last gradient queued."""
    if args.dry_run:
        return {"skipped": "no CUDA device in a dry run"}
    script = with_import(workdir, WORKLOADS / "release_probe.py")
    out = workdir / "out_release"
    with _Daemon(workdir, "--no-lease", "--policy", "exclusive") as d:
        env = {**os.environ, "CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_JOB_NAME": "release-probe",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": checkout_on_path(os.environ)}
        res = subprocess.run([sys.executable, "-c", "from horovod.runner.launch import run_commandline; "
                              "run_commandline()", "-np", "1", "-H", "localhost:1", "--gloo",
                              sys.executable, str(script), "--out", str(out), "--sleep-ms", str(args.sleep_ms)],
                             env=env, capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            raise RuntimeError(f"release probe exited {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}")
        time.sleep(0.5)
        events = read_events(d.events)
    probe = rank_summaries(out)[0]
    releases = [e.t for e in events if e.name is EventName.RELEASE and e.job_name == "release-probe"]
    return judge_release(probe["launched"], releases, probe["sleep_s"])


def judge_release(launched: list[float], releases: list[float], sleep_s: float) -> dict[str, Any]:
    """Each launch of the GPU sleep against the first release after it: every one must come ≥ 90 % of the
    sleep later (a release when the CPU is done comes about one round trip after the launch)."""
    margins = []
    for t in launched:
        after = [r for r in releases if r > t]
        if after:
            margins.append(after[0] - t)
    ok = bool(launched) and len(margins) == len(launched) and all(m >= 0.9 * sleep_s for m in margins)
    return {"sleep_ms": 1000 * sleep_s, "iterations": len(launched),
            "release_after_launch_ms": [round(1000 * m, 2) for m in margins], "released_after_device_work": ok}


# ---- the co-located jobs ----------------------------------------------------------------------------


def _job_cmd(script: Path, args: argparse.Namespace, out: Path, seed: int, peer_ms: float, iters: int,
             stop: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(script), "--framework", args.framework, "--model", args.model,
           "--batch", str(args.batch), "--image-size", str(args.image_size), "--classes", str(args.classes),
           "--iters", str(iters), "--seed", str(seed), "--peer-node", "node1",
           "--peer-compute-ms", f"{peer_ms:.2f}", "--out", str(out)]
    if args.dry_run:
        cmd.append("--cpu")
    return cmd + (["--stop-file", str(stop)] if stop else [])


def _spec(args: argparse.Namespace, rate: float) -> ClusterSpec:
    usable = sorted(os.sched_getaffinity(0))
    return ClusterSpec(nodes=2, link=Link(rate_mbit=rate), policy="passthrough",
                       gpu_nodes=() if args.dry_run else (0,), cores=(usable[0], usable[-1]),
                       daemon_args=("--adapt-window", f"{args.adapt_window:g}"))


def run_solo(name: str, args: argparse.Namespace, rate: float, peer_ms: float, iters: int, workdir: Path
             ) -> dict[str, Any]:
    """One job alone (policy passthrough): its summaries, events and measured window."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = with_import(workdir, WORKLOADS / "train_gpu.py")
    with Cluster(_spec(args, rate), workdir=workdir / "cluster") as cluster:
        job = cluster.run(_job_cmd(script, args, workdir / f"out_{name}", 1000, peer_ms, iters), name=name,
                          env=args.job_env, framework=args.framework)
        if job.wait(args.job_timeout) != 0:
            raise RuntimeError(f"{name} failed:\n{job.output()[-3000:]}")
        events = {n.name: read_events(n.event_log) for n in cluster.nodes}
    return solo_result(name, events, workdir / f"out_{name}", args.warmup)


def check_speedup(args: argparse.Namespace, workdir: Path, deadline: float) -> dict[str, Any]:
    """Calibrate, run the jobs through interleaved policy segments, then one alone; judge.

    With --mps every job (the solo runs too) is a client of an MPS control daemon this run starts
    in its own folders: each mode is then that mode plus MPS, and `unscheduled` is MPS alone."""
    with _mps_env(args, workdir) as env:
        args.job_env = {**args.env, **env}
        result = _speedup(args, workdir, deadline)
    if args.mps:
        result["mps"] = True
    return result


def _speedup(args: argparse.Namespace, workdir: Path, deadline: float) -> dict[str, Any]:
    reasons = preflight()
    if reasons:
        raise RuntimeError("cannot build the emulated cluster: " + "; ".join(reasons))
    cal = run_solo("calibration", args, args.ref_rate, 0.0, args.warmup + args.calibration_iters,
                   workdir / "calibration")
    c, m = phase_medians(cal["events"]["node0"], args.warmup)
    rate = float(round(min(args.max_rate, max(args.min_rate, m * args.ref_rate / (args.ratio * c)))))
    _log(f"calibration: compute {1000 * c:.1f} ms, allreduce {1000 * m:.1f} ms at {args.ref_rate:g} Mbit/s "
         f"-> link {rate:g} Mbit/s for comm:compute {args.ratio:g}")
    peer_ms = 1000 * c
    script = with_import(workdir, WORKLOADS / "train_gpu.py")
    stop = workdir / "stop"
    names = [f"job{k}" for k in range(args.jobs)]
    segments: list[dict[str, Any]] = []
    with Cluster(_spec(args, rate), workdir=workdir / "cluster") as cluster:
        jobs = [cluster.run(_job_cmd(script, args, workdir / f"out_{n}", 1000 + k, peer_ms, 1_000_000, stop),
                            name=n, env=args.job_env, framework=args.framework) for k, n in enumerate(names)]
        admin = ClusterAdmin(cluster)
        seg_s = args.settle_s + args.segment_s
        modes = ((PRIORITY_MODES + (("classes-adaptive",) if args.adaptive else ())) if args.priority
                 else MODES + (("adaptive",) if args.adaptive else ()))
        if args.priority:
            try:
                cluster.honour_dscp(True)
                cluster.honour_dscp(False)
            except Unsupported as exc:
                _log(f"no mode classes-dscp: {exc}")
                modes = tuple(m for m in modes if m not in DSCP)
        try:
            wait_warm(cluster, jobs, names, args.warmup, timeout=args.job_timeout)
            ids = job_ids(cluster)
            for cycle in range(args.cycles):
                # Leave time for the solo run after the last cycle.
                if cycle and time.monotonic() + len(modes) * seg_s + args.solo_reserve_s > deadline:
                    _log(f"stopping after {cycle} cycles: the time budget is spent")
                    break
                k = cycle % len(modes)
                for mode in modes[k:] + modes[:k]:
                    _log(f"cycle {cycle + 1}/{args.cycles}: {mode}")
                    admin.set_policy(POLICY[mode], adapt=mode in ADAPTS, handover=mode not in CPU_HANDOVER)
                    if args.priority:
                        admin.set_class([ids[n] for n in names[1:]], low=mode in CLASSES)
                        cluster.honour_dscp(mode in DSCP)
                    t_switch = time.monotonic()
                    time.sleep(settle_s(mode, args.settle_s, args.adapt_window))
                    a = time.monotonic()
                    time.sleep(args.segment_s)
                    b = time.monotonic()
                    for j in jobs:
                        if j.poll() is not None:
                            raise RuntimeError(f"{j.name} exited during the run:\n{j.output()[-3000:]}")
                    segments.append({"cycle": cycle, "mode": mode, "switch": t_switch, "a": a, "b": b,
                                     "running": list(names), "visitors": [], "load1": os.getloadavg()[0]})
        finally:
            admin.close()
            stop.touch()
        for j in jobs:
            if j.wait(args.job_timeout) != 0:
                raise RuntimeError(f"{j.name} failed:\n{j.output()[-3000:]}")
        events = {n.name: read_events(n.event_log) for n in cluster.nodes}
    _log("job1 alone")
    solo = run_solo("job1", args, rate, peer_ms, args.warmup + args.solo_iters, workdir / "solo")
    scenario = Scenario(f"gpu {args.model} b{args.batch} comm:compute {args.ratio:g} x{args.jobs}", args.ratio,
                        args.jobs)
    raw = {"scenario": scenario.name, "rate_mbit": rate, "batch": args.batch, "segments": segments,
           "events": events, "policy_source_sha256": "", "solos": [solo],
           "jobs": {n: rank_summaries(workdir / f"out_{n}") for n in names}, "visitors": {}}
    summary = summarize(scenario, raw)
    plot_timeline(raw, args.out / "gpu_timeline.png",
                  f"{args.model} batch {args.batch} on {'CPU (dry run)' if args.dry_run else 'one GPU'}: link "
                  f"{rate:g} Mbit/s, alone C {summary['alone_C_ms']:.0f} ms / M {summary['alone_M_ms']:.0f} ms",
                  args.timeline_seconds)
    params = rank_summaries(workdir / "out_job0")[0]["params"]
    out = {"calibration": {"rate_mbit": args.ref_rate, "C_ms": 1000 * c, "M_ms": 1000 * m, "params": params},
           "rate_mbit": rate, "peer_compute_ms": peer_ms, "summary": summary}
    if args.priority:  # each job's speed relative to alone, per mode: job0 is the production job
        out["speed_vs_alone"] = {mode: {job: round(1 / v["slowdown"], 3) for job, v in r["jobs"].items()
                                        if v.get("slowdown")}
                                 for mode, r in summary["modes"].items() if mode != "sequential"}
        _log(f"speed relative to alone (job0 the production job): {out['speed_vs_alone']}")
        phases = {mode: {job: "/".join("-" if v.get(k) is None else f"{v[k]:.0f}" for k in ("C_ms", "M_ms"))
                         for job, v in r["jobs"].items()} for mode, r in summary["modes"].items()}
        _log(f"each job's median compute/comm ms on the GPU node: {phases}")
    return out


def _table(summary: dict[str, Any]) -> str:
    rows = [f"{'mode':<16} {'samples/s':>10} {'vs unsch.':>9} {'vs seq.':>8} {'of bound':>8} {'busy':>5} "
            f"{'C ms':>6} {'C GPU':>6} {'M ms':>6} {'cycles':>6}"]
    for mode in ("sequential", *(m for m in (*MODES, "adaptive", "classes", "classes-dscp", "classes-adaptive")
                                       if m in summary["modes"])):
        r = summary["modes"][mode]

        def f(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        node0 = r.get("C_ms_by_node", {}).get("node0")
        c_gpu = format(node0, "6.1f") if isinstance(node0, (int, float)) else f"{'-':>6}"
        rows.append(f"{mode:<16} {f('aggregate_samples_per_s', '10.0f')} {f('vs_unscheduled', '9.3f')} "
                    f"{f('vs_sequential', '8.3f')} {f('of_bound', '8.3f')} {f('busy_fraction_mean', '5.2f')} "
                    f"{f('C_ms', '6.1f')} {c_gpu} {f('M_ms', '6.1f')} {r.get('cycles', 0):>6}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU: node 0 is a core, a small model on small images (CI)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "results/gpu"),
                   help="folder for gpu.json and gpu_timeline.png (default $OUT, else results/gpu)")
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="the speed-up check's jobs: Horovod, or DDP under torchrun (Gloo: NCCL cannot pair the GPU "
                        "rank with its CPU stand-in on the other node)")
    p.add_argument("--model", default=None, help="torchvision model (default resnet18)")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default 128; dry run 8)")
    p.add_argument("--image-size", type=int, default=None, help="default 224; dry run 32")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=2, help="co-located identical jobs in the speed-up check (2..8)")
    p.add_argument("--ratio", type=float, default=1.0, help="wanted comm:compute of a job alone")
    p.add_argument("--ref-rate", type=float, default=None, help="calibration link rate, Mbit/s "
                   "(default 10000; dry run 1000)")
    p.add_argument("--min-rate", type=float, default=50.0)
    p.add_argument("--max-rate", type=float, default=40000.0)
    p.add_argument("--cycles", type=int, default=None, help="cycles through the modes (default 3; dry 1)")
    p.add_argument("--segment-s", type=float, default=None, help="measured seconds per segment (default 8; dry 1.5)")
    p.add_argument("--settle-s", type=float, default=None, help="seconds after a switch (default 2; dry 0.5)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before measuring (default 10; dry 2)")
    p.add_argument("--calibration-iters", type=int, default=None, help="default 20; dry 3")
    p.add_argument("--solo-iters", type=int, default=None, help="measured iterations alone (default 40; dry 3)")
    p.add_argument("--sleep-ms", type=float, default=200.0, help="GPU work queued after the last gradient "
                   "in the release check")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop adding cycles when this much time has "
                   "passed, leaving time for the run alone")
    p.add_argument("--job-timeout", type=float, default=180.0)
    p.add_argument("--timeline-seconds", type=float, default=None)
    p.add_argument("--only", default="handover,gapcost,inventory,release,speedup", help="comma-separated checks to run")
    p.add_argument("--priority", action="store_true", help="the speed-up check measures priorities instead: "
                   "job0 the production job, the others `low` in mode `classes`, and in `classes-dscp` with the "
                   "emulated links sending the low jobs' DSCP-marked packets after the others', beside unscheduled "
                   "and crossover with equal classes; each job's slowdown against alone is in the summary")
    p.add_argument("--adaptive", action="store_true",
                   help="also measure `adaptive`: crossover with each device measuring whether its grants pay "
                        "(crossoverd's default, --adapt); with --priority, `classes-adaptive` instead: classes "
                        "with each device keeping grants only where they pay the production job; the other modes "
                        "grant everywhere")
    p.add_argument("--adapt-window", type=float, default=1.0,
                   help="with --adaptive: the daemons' --adapt-window (s); a window should hold several iterations")
    p.add_argument("--mps", action="store_true", help="run the speed-up check's jobs under an MPS control "
                   "daemon of this run's own (unscheduled is then MPS alone; the GPU's settings are left as they are)")
    p.add_argument("--handover-turns", type=int, default=None, help="turns per process in each hand-over path "
                   "(default 200; dry run 20)")
    p.add_argument("--handover-work-ms", type=float, default=2.0, help="length of one turn of GPU work (ms)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="the speed-up check's jobs (their solo runs too) get this in their environment, e.g. "
                        "CROSSOVER_HOST_STAGING=1; repeatable")
    p.add_argument("--gap-rounds", type=int, default=None, help="gapcost: timed rounds per condition "
                   "(default 20; dry run 2)")
    p.add_argument("--gap-idle-ms", type=float, default=5.0,
                   help="gapcost: idle time before each timed step, as a ring's wait leaves the GPU to the neighbour")
    p.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    dry = args.dry_run
    for key, full, small in (("model", "resnet18", "resnet18"), ("batch", 128, 8), ("image_size", 224, 32),
                             ("ref_rate", 10000.0, 1000.0), ("cycles", 3, 1), ("segment_s", 8.0, 1.5),
                             ("settle_s", 2.0, 0.5), ("warmup", 10, 2), ("calibration_iters", 20, 3),
                             ("solo_iters", 40, 3), ("timeline_seconds", 1.0, 1.5),
                             ("handover_turns", 200, 20), ("gap_rounds", 20, 2)):
        if getattr(args, key) is None:
            setattr(args, key, small if dry else full)
    bad = [e for e in args.env if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        print(f"bench.gpu: error: --env {bad[0]!r}: expected NAME=VALUE", file=sys.stderr)
        return 2
    args.env = dict(e.split("=", 1) for e in args.env)
    if not 2 <= args.jobs <= 8:
        print(f"bench.gpu: error: --jobs {args.jobs}: the speed-up check co-locates 2..8 jobs", file=sys.stderr)
        return 2
    if dry:
        args.classes = min(args.classes, 10)
    args.solo_reserve_s = 40.0
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="xo-gpu-")
    workdir = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)

    report: dict[str, Any] = {"benchmark": "gpu", "version": 1, "time": time.time(), "dry_run": dry,
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "environment": environment(), "checks": {}}
    _log(f"environment: {json.dumps(report['environment'])}")
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "handover": lambda: check_handover(args, workdir / "handover"),
        "gapcost": lambda: check_gap_cost(args, workdir / "gapcost"),
        "inventory": lambda: check_inventory(args, workdir / "inventory"),
        "release": lambda: check_release(args, workdir / "release"),
        "speedup": lambda: check_speedup(args, workdir / "speedup", deadline),
        "memory": lambda: check_memory(args, workdir / "memory"),
    }
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in checks]
    if unknown:
        print(f"bench.gpu: error: --only: no check {', '.join(unknown)} (known: {', '.join(checks)})",
              file=sys.stderr)
        return 2
    failed = []
    for name in wanted:
        _log(f"{name} ...")
        t = time.monotonic()
        (workdir / name).mkdir(parents=True, exist_ok=True)
        try:
            result = checks[name]()
            result["ok"] = result.get("ok", result.get("released_after_device_work", True))
        except Exception as exc:  # noqa: BLE001 - report it and go on to the next check
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["elapsed_s"] = round(time.monotonic() - t, 1)
        report["checks"][name] = result
        if not result["ok"]:
            failed.append(name)
        shown = {k: v for k, v in result.items() if k not in ("summary", "traceback")}
        _log(f"{name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(shown, default=str)[:1500]}")
        if "summary" in result:
            print(_table(result["summary"]), flush=True)
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(args.out / "gpu.json", report)
    _log(f"wrote {args.out / 'gpu.json'} in {report['elapsed_s']} s; "
         + (f"failed: {', '.join(failed)}" if failed else "every check passed"))
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed else 0

