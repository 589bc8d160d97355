"""Crossover on an emulated cluster: co-located Horovod jobs, with and without scheduling.

Two nodes (network namespaces on one machine, `testbed.cluster`), each with
one device (a CPU core its ranks are pinned to) and a tc-shaped link; three in
`span x2`, where job0 runs on nodes 0-1 and job1 on nodes 1-2, so they share
only node 1's device (on a 2-core machine nodes 0 and 2 share a core, which no
daemon schedules: see docs/emulated-cluster.md). Every
job is a real PyTorch MLP classifier trained data-parallel under Horovod
(testbed/workloads/train_bench.py with `import crossover.auto` prepended), one
rank per node. A calibration measures compute time per sample and allreduce
time per link rate; each scenario picks the rate and batch that give the wanted
comm:compute ratio at about --iter-ms per iteration.

The machine is shared and its load swings within seconds, so the co-located
modes are measured *interleaved inside one run*: the jobs of a scenario start
once and train continuously while the harness switches the policy on both
daemons at once (SetPolicy), cycling through segments (order rotated each
cycle); each segment is measured after a settle time:

  unscheduled  policy `passthrough` (the plugin only observes)
  exclusive    one compute phase per device, FIFO
  crossover    request order, clearly shorter computes first (the default policy)

and `sequential` (jobs one after another) comes from solo runs of the first job
before and of the last job after the co-located run (identical jobs: running
them one after another gives one job's alone throughput). Ratios are taken
within a cycle and the table shows medians over cycles.

Metrics: aggregate samples/s, each job's iteration time and slowdown vs alone,
device-busy fraction (union of compute intervals / wall, from the daemons'
event logs), the pipeline bound (identical jobs: Σbatch / max(ΣC, ΣM, T_alone),
C and M measured alone), and how often the two nodes granted in the same order.

    python -m bench.emulated                    # 6 scenarios (~30 min on 2 cores)
    python -m bench.emulated --quick            # 1:1 with two jobs (~3 min)
    python -m bench.emulated --host-wait spin   # stock Horovod waiting (see _POLL_SHIM)
    python -m bench.emulated --host-cores 2-15  # device cores run only compute (needs spare cores)
    python -m bench.emulated --device model     # a GPU-like emulated device per node (testbed.device_model)
    python -m bench.emulated --device model --adaptive --switch-us 0   # also the default's adaptive rule

With `--device model` a node's device is not a core: each rank submits its compute
phase to the node's device server, which time-slices concurrent contexts and slows
compute beside an allreduce (docs/emulated-cluster.md, "The device model"). Compute
then costs no CPU, so the two cores are left to Gloo, TCP, the daemons and the ranks.

Writes `results/emulated.json` (`--out`) and `results/crossover_timeline.png` (`--timeline`).
The scenarios are in `bench.emulated.scenarios`; a run is judged by `bench.emulated.judge` and shown by
`bench.emulated.report`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NamedTuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.emulated.judge import phase_medians, summarize
from bench.emulated.report import plot_timeline, render
from bench.emulated.scenarios import (
    ADAPTS,
    ALL,
    COLOCATED,
    CPU_HANDOVER,
    FULL,
    MODEL,
    POLICY,
    QUICK,
    Scenario,
    settle_s,
)
from bench.lib.results import ROOT, machine, write_json
from crossover.client.admin import AdminClient
from crossover.protos.event_file import EventName, read_events, typed
from crossover.settings import SettingError, parse_cpu_list
from testbed.cluster import Cluster, ClusterSpec, Link, preflight
from testbed.device_model import DeviceParams
from testbed.harness.jobs import WORKLOADS, rank_summaries, with_import

WORKLOAD = WORKLOADS / "train_bench.py"
console = Console(stderr=True)


# Horovod 0.28.1's `synchronize()` waits for an allreduce in a sched_yield() loop
# (`horovod_torch_wait_and_clear`): a rank in its comm phase keeps its core ~95% busy
# (measured: 2.4 s of CPU in a 3 s wait). On a GPU that spin runs on a host core, not on
# the device; here the core *is* the device, so the spin steals the co-located job's
# compute. `--host-wait poll` prepends this shim (poll + 1 ms sleep; ~8% of a core)
# so the emulated device behaves like a GPU; `spin` runs stock Horovod.
_POLL_SHIM = """
import time as _xo_time
import horovod.torch.mpi_ops as _xo_ops
import horovod.torch.optimizer as _xo_opt

def _xo_sleep_sync(handle, _poll=_xo_ops.poll, _sync=_xo_opt.synchronize):
    while not _poll(handle):
        _xo_time.sleep(0.001)
    return _sync(handle)
_xo_opt.synchronize = _xo_sleep_sync
"""


def _script(workdir: Path, host_wait: str, framework: str = "horovod") -> Path:
    """The workload with the import; Horovod's spinning wait is replaced where `host_wait` says (DDP's sleeps)."""
    workdir.mkdir(parents=True, exist_ok=True)
    poll = host_wait == "poll" and framework == "horovod"
    return with_import(workdir, WORKLOAD, prelude=_POLL_SHIM if poll else "")


def _job_cmd(script: Path, args: argparse.Namespace, batch: int, out: Path, seed: int,
             iters: int = 1_000_000, stop: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(script), "--framework", args.framework, "--iters", str(iters), "--batch", str(batch),
           "--width", str(args.width),
           "--depth", str(args.depth), "--in-dim", str(args.in_dim), "--seed", str(seed), "--out", str(out)]
    if args.device_params is not None:
        cmd += ["--device-ms-per-sample", str(args.device_ms_per_sample)]
        if getattr(args, "handover", False):  # turns can end before the device has done them (docs/handover.md)
            cmd += ["--queue-device-work"]
        elif getattr(args, "device_in_backward", False):  # a yield at a gradient cuts the phase short
            cmd += ["--device-in-backward"]
    return cmd + (["--stop-file", str(stop)] if stop else [])


def host_cores_plan(raw: str, usable: set[int], nodes: int = 2) -> tuple[tuple[int, ...], dict[str, str]]:
    """`--host-cores`: the nodes' device cores (usable cores not named, lowest first) and the jobs' environment.

    Each rank's compute thread then stays on its node's device core while its other
    threads (Horovod's loop with Gloo, gRPC) run on the host cores, as on a GPU node.
    """
    if not raw:
        return (), {}
    host = set(parse_cpu_list(raw))
    missing = sorted(host - usable)
    if missing:
        raise ValueError(f"--host-cores {raw}: cores {missing} are not usable here (usable: {sorted(usable)})")
    devices = sorted(usable - host)[:nodes]
    if len(devices) < nodes:
        raise ValueError(f"--host-cores {raw} leaves {len(devices)} of the {len(usable)} usable cores for "
                         f"{nodes} device cores: every node needs one core that only its ranks' compute uses")
    return tuple(devices), {"CROSSOVER_HOST_CORES": ",".join(map(str, sorted(host)))}


def _cluster_spec(rate: float, args: argparse.Namespace, nodes: int = 2) -> ClusterSpec:
    return ClusterSpec(nodes=nodes, link=Link(rate_mbit=rate), policy="passthrough", nice=args.nice,
                       cores=tuple(args.device_cores[:nodes]), device_model=args.device_params,
                       daemon_args=("--adapt-window", f"{args.adapt_window:g}"))


def calibrate(rate: float, batch: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One job alone for a few iterations: medians of its compute (grant→release) and comm phases."""
    script = _script(workdir, args.host_wait, args.framework)
    with Cluster(_cluster_spec(rate, args),
                 workdir=workdir / "cluster") as cluster:
        job = cluster.run(_job_cmd(script, args, batch, workdir / "out", 1000, iters=16), name="calibration",
                          env=args.job_env, framework=args.framework)
        if job.wait(args.job_timeout) != 0:
            raise RuntimeError(f"calibration failed:\n{job.output()[-3000:]}")
        events = [e for n in cluster.nodes for e in read_events(n.event_log)]
    c, m = phase_medians(events, skip=8)
    return {"rate_mbit": rate, "batch": batch, "C": c, "M": m,
            "params": rank_summaries(workdir / "out")[0]["params"]}


class ClusterAdmin:
    """Steer every daemon of the cluster, back to back over clients opened once (also bench.gpu)."""

    def __init__(self, cluster: Cluster) -> None:
        self._admins = [AdminClient(n.socket, timeout=5) for n in cluster.nodes]

    def set_policy(self, name: str, adapt: bool | None = None, handover: bool | None = None,
                   protect: float | None = None) -> None:
        """Switch every daemon to policy `name`; `adapt` also switches whether devices measure if grants pay,
        `handover` whether ranks end their turns on their device, `protect` the isolation target."""
        for admin in self._admins:
            admin.set_policy(name, adapt=adapt, handover=handover, protect=protect)

    def set_class(self, jobs: list[str], low: bool, nodes: Sequence[int] | None = None) -> None:
        """Put `jobs` (ids) in class `low` on the daemons of `nodes` (None: every one), or back in `normal`
        (`crossover priority`'s call, which a daemon refuses for a job without ranks on its node)."""
        for admin in self._admins if nodes is None else [self._admins[n] for n in nodes]:
            for job in jobs:
                admin.set_job_class(job, "low" if low else "normal")

    def close(self) -> None:
        for admin in self._admins:
            admin.close()


class _Visitor(NamedTuple):
    name: str
    job: Any
    folder: Path  # its go and stop files, and its ranks' summaries (out/)


class _Visitors:
    """Churn: a job like job 0 that arrives and leaves inside every measured segment.

    Each visitor is started one segment ahead and waits for its go file before hvd.init, so
    what lands in a segment is its arrival (rendezvous, registration, first grants) and its
    leaving, not its interpreter's start-up; the next one's start-up runs in every segment
    alike. It leaves on its stop file, part-way through the segment.
    """

    def __init__(self, cluster: Cluster, script: Path, args: argparse.Namespace, batch: int, workdir: Path) -> None:
        self._cluster, self._script, self._args, self._batch, self._workdir = cluster, script, args, batch, workdir
        self._count = 0
        self._next = self._launch()
        self.outs: dict[str, Path] = {}

    def _launch(self) -> _Visitor:
        name = f"visitor{self._count}"
        self._count += 1
        d = self._workdir / name
        d.mkdir(parents=True, exist_ok=True)
        for flag in ("go", "stop"):
            (d / flag).unlink(missing_ok=True)
        cmd = _job_cmd(self._script, self._args, self._batch, d / "out", 2000 + self._count, stop=d / "stop")
        job = self._cluster.run(cmd + ["--go-file", str(d / "go")], name=name, env=self._args.job_env,
                                framework=self._args.framework)
        return _Visitor(name, job, d)

    def arrive(self) -> _Visitor:
        """Let the waiting visitor join; start the next one's interpreter."""
        visitor, self._next = self._next, self._launch()
        (visitor.folder / "go").touch()
        return visitor

    @staticmethod
    def leave(visitor: _Visitor) -> None:
        """Tell it to stop at its next iteration boundary."""
        (visitor.folder / "stop").touch()

    def finish(self, visitor: _Visitor) -> None:
        """Make it leave (if it has not) and wait for it to end."""
        self.leave(visitor)
        if visitor.job.wait(self._args.job_timeout) != 0:
            raise RuntimeError(f"{visitor.name} failed:\n{visitor.job.output()[-3000:]}")
        self.outs[visitor.name] = visitor.folder / "out"

    def close(self) -> None:
        """The visitor that was started for a segment that never came: let it join and leave at once."""
        self.leave(self._next)
        (self._next.folder / "go").touch()
        self._next.job.wait(self._args.job_timeout)


def run_solo(name: str, seed: int, rate: float, batch: int, args: argparse.Namespace, workdir: Path,
             nodes: Sequence[int] | None = None) -> dict[str, Any]:
    """One job alone on a fresh cluster (policy passthrough), on `nodes` (None: every node, a rank each): its
    iteration, compute and comm times."""
    script = _script(workdir, args.host_wait, args.framework)
    with Cluster(_cluster_spec(rate, args),
                 workdir=workdir / "cluster") as cluster:
        job = cluster.run(_job_cmd(script, args, batch, workdir / f"out_{name}", seed, iters=args.solo_iters),
                          name=name, env=args.job_env, nodes=nodes, framework=args.framework)
        if job.wait(args.job_timeout) != 0:
            raise RuntimeError(f"solo {name} failed:\n{job.output()[-3000:]}")
        events = {n.name: read_events(n.event_log) for n in cluster.nodes}
    return solo_result(name, events, workdir / f"out_{name}", args.warmup)


def solo_result(name: str, events: dict[str, Any], out: Path, warmup: int) -> dict[str, Any]:
    """A job run alone: its ranks' summaries (in `out`), the nodes' events, and its iterations after `warmup`
    as the `sequential` segment the judge reads."""
    ranks = rank_summaries(out)
    r0 = min(ranks, key=lambda r: r["rank"])
    its = list(zip(r0["iter_start"], r0["iter_end"]))[warmup:]
    seg = {"cycle": -1, "mode": "sequential", "a": its[0][0], "b": its[-1][1], "running": [name],
           "load1": os.getloadavg()[0]}
    return {"name": name, "events": events, "jobs": {name: ranks}, "segment": seg}


def run_scenario(scn: Scenario, rate: float, batch: int, args: argparse.Namespace, workdir: Path,
                 step: Callable[[str], None]) -> dict[str, Any]:
    """Solo run of the first job; all jobs co-located, cycling the policies as segments; solo run of the last job.

    Solo runs bracket the co-located run in time, so a drift of the machine's load shows up
    on both sides of the comparison. (Pausing jobs inside the co-located run would be more
    tightly interleaved, but leaves the paused job iterations behind, which a policy that
    orders by iteration count then pays back: an artifact, not the scenario.)
    """
    script = _script(workdir, args.host_wait, args.framework)
    stop = workdir / "stop"
    stop.unlink(missing_ok=True)  # left by an earlier run in the same --workdir, it would stop the jobs at once
    spec = _cluster_spec(rate, args, scn.nodes)
    names = [f"job{k}" for k in range(scn.jobs)]
    segments: list[dict[str, Any]] = []
    # The policy is edited while we measure: record which source the daemons loaded.
    policy_src = ROOT / "crossover" / "daemon" / "policies" / "crossover.py"
    policy_sha = hashlib.sha256(policy_src.read_bytes()).hexdigest()[:12]
    batches = [scn.batch(k, batch) for k in range(scn.jobs)]
    mixed = bool(scn.batch_scale)
    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batches}: {names[0]} alone")
    # Identical jobs: the first alone before, the last after. Mixed jobs: every job alone, before.
    solos = [run_solo(names[k], 1000 + k, rate, batches[k], args, workdir / f"solo_{k}")
             for k in (range(scn.jobs) if mixed else [0])]
    with Cluster(spec, workdir=workdir / "cluster") as cluster:
        jobs = [cluster.run(_job_cmd(script, args, batches[k], workdir / f"out_{n}", 1000 + k, stop=stop), name=n,
                            nodes=scn.nodes_of(k), env=args.job_env, framework=args.framework)
                for k, n in enumerate(names)]
        admin = ClusterAdmin(cluster)
        visitors = _Visitors(cluster, script, args, batches[0], workdir) if scn.visitor else None
        try:
            wait_warm(cluster, jobs, names, args.warmup)
            colocated = _colocated(args)
            for cycle in range(args.cycles):
                k = cycle % len(colocated)
                for mode in colocated[k:] + colocated[:k]:
                    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batch}: cycle {cycle + 1}/{args.cycles} {mode}")
                    admin.set_policy(POLICY[mode], adapt=mode in ADAPTS, handover=mode not in CPU_HANDOVER)
                    t_switch = time.monotonic()
                    # An adaptive device's later re-probes fall inside the measured segments.
                    time.sleep(settle_s(mode, args.settle_s, args.adapt_window))
                    a = time.monotonic()
                    running = list(names)
                    if visitors is None:
                        time.sleep(args.segment_s)
                    else:
                        visitor = visitors.arrive()
                        time.sleep(0.6 * args.segment_s)
                        visitors.leave(visitor)
                        time.sleep(0.4 * args.segment_s)
                        running.append(visitor.name)
                    b = time.monotonic()
                    for j in jobs:
                        if j.poll() is not None:
                            raise RuntimeError(f"{j.name} exited during the run:\n{j.output()[-3000:]}")
                    if visitors is not None:
                        visitors.finish(visitor)
                    segments.append({"cycle": cycle, "mode": mode, "switch": t_switch, "a": a, "b": b,
                                     "running": running, "visitors": running[len(names):],
                                     "load1": os.getloadavg()[0]})
        finally:
            admin.close()
            stop.touch()
            if visitors is not None:
                visitors.close()
        for j in jobs:
            if j.wait(args.job_timeout) != 0:
                raise RuntimeError(f"{j.name} failed:\n{j.output()[-3000:]}")
        events = {n.name: read_events(n.event_log) for n in cluster.nodes}
    step(f"{scn.name} @ {rate:g} Mbit/s, batch {batches}: {names[-1]} alone")
    if not mixed:
        solos.append(run_solo(names[-1], 1000 + len(names) - 1, rate, batches[-1], args, workdir / "solo_last"))
    return {"scenario": scn.name, "rate_mbit": rate, "batch": batch, "segments": segments, "events": events,
            "policy_source_sha256": policy_sha, "solos": solos,
            "jobs": {n: rank_summaries(workdir / f"out_{n}") for n in names},
            "visitors": {n: rank_summaries(out) for n, out in (visitors.outs.items() if visitors else ())}}


def job_ids(cluster: Cluster, timeout: float = 30.0) -> dict[str, str]:
    """Job name -> job id, from node 0's event log (the jobs have registered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = {str(e.job_name): e.job for e in typed(cluster.events(0)) if e.name is EventName.REGISTER and e.job}
        if ids:
            return ids
        time.sleep(0.2)
    raise RuntimeError(f"no job registered on node 0 in {timeout:.0f} s")


def _colocated(args: argparse.Namespace) -> tuple[str, ...]:
    """The co-located modes this run cycles through."""
    return COLOCATED + (("crossover-cpu",) if args.handover else ()) + (("adaptive",) if args.adaptive else ())


def wait_warm(cluster: Cluster, jobs: list[Any], names: list[str], warmup: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for j in jobs:
            if j.poll() is not None:
                raise RuntimeError(f"{j.name} exited before the measurement:\n{j.output()[-3000:]}")
        ends = [[e.job_name for e in typed(cluster.events(i)) if e.name is EventName.COMM_END]
                for i in range(len(cluster.nodes))]
        if all(max(node.count(n) for node in ends) >= warmup for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"jobs did not reach {warmup} iterations in {timeout:.0f}s")


def parser() -> argparse.ArgumentParser:
    """The bed's options; `bench.priority` starts its own beds from their defaults."""
    p = argparse.ArgumentParser(prog="python -m bench.emulated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1:1 with two jobs only")
    p.add_argument("--scenarios", help="comma-separated, from: " + ", ".join(s.name for s in ALL)
                   + " (default: all but the last, churn, which needs cores beside the devices)")
    p.add_argument("--cycles", type=int, default=None, help="cycles through the 4 modes (default 4, quick 3)")
    p.add_argument("--segment-s", type=float, default=None, help="measured seconds per segment (default 20 x "
                   "--iter-ms)")
    p.add_argument("--settle-s", type=float, default=1.5, help="seconds after a switch before measuring")
    p.add_argument("--warmup", type=int, default=5, help="iterations every job does before the first segment")
    p.add_argument("--solo-iters", type=int, default=25, help="iterations of each solo (alone) run")
    p.add_argument("--iter-ms", type=float, default=450.0, help="target alone iteration time (C + M)")
    p.add_argument("--adaptive", action="store_true",
                   help="also measure `adaptive`: the crossover policy with each device measuring whether its "
                        "grants pay (crossoverd's default, --adapt); the other modes grant everywhere")
    p.add_argument("--adapt-window", type=float, default=3.0,
                   help="with --adaptive: the daemons' --adapt-window (s); a window should hold several iterations")
    p.add_argument("--handover", action="store_true",
                   help="also measure `crossover-cpu`: the crossover policy with every rank waiting for its device "
                        "on its CPU before it releases, beside `crossover`, whose ranks end their turns on the "
                        "device model (docs/handover.md); every job then queues its device work (train_bench "
                        "--queue-device-work), so its allreduce overlaps it")
    p.add_argument("--mps", action="store_true",
                   help="device model: an MPS-like device, whose contexts share it without switching "
                        "(--switch-us 0); compute still slows beside an allreduce")
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="the jobs' framework: Horovod (horovodrun's Gloo launcher) or PyTorch DDP (torchrun per "
                        "node, Gloo); the same model, data and scenarios")
    p.add_argument("--device", choices=("core", "model"), default="core",
                   help="core: a node's device is a CPU core its ranks compute on; model: a GPU-like emulated "
                        "device per node (compute costs no CPU; see docs/emulated-cluster.md)")
    defaults = DeviceParams()
    p.add_argument("--slice-us", type=float, default=defaults.slice_us,
                   help="device model: time slice per context (µs)")
    p.add_argument("--switch-us", type=float, default=defaults.switch_us,
                   help="device model: cost of one context switch (µs)")
    p.add_argument("--interference", type=float, default=defaults.interference,
                   help="device model: compute slowdown beside an allreduce (0.19 = 19%%)")
    p.add_argument("--device-ms-per-sample", type=float, default=1.0,
                   help="device model: device time per training sample (ms); sets the batch for a compute phase")
    p.add_argument("--width", type=int, default=None, help="MLP width (default 1024; 512 with --device model, "
                   "so the allreduces move fewer bytes through the two cores)")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--in-dim", type=int, default=512)
    p.add_argument("--ref-rate", type=float, default=200.0, help="first calibration link rate, Mbit/s")
    p.add_argument("--host-wait", choices=("spin", "poll"), default="poll",
                   help="poll: ranks wait for allreduces with poll + sleep, so a rank in its comm phase leaves "
                        "the emulated device free, as on a GPU; spin: stock Horovod 0.28.1, whose wait spins on "
                        "the device core")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of daemons and ranks; e.g. -10 keeps the emulated devices from being shared "
                        "with other work on the machine (slows that work down)")
    p.add_argument("--host-cores", default="",
                   help="cores (e.g. 2-7) for the ranks' host threads (Horovod's loop, Gloo, gRPC) while "
                        "their compute stays on the node's device core, as on a GPU node; needs two cores "
                        "beside these for the devices (a 16-core machine, not a 2-core one)")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--timeline-seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=Path("results/emulated.json"))
    p.add_argument("--timeline", type=Path, default=Path("results/crossover_timeline.png"))
    p.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir, removed)")
    return p


def main() -> int:
    args = parser().parse_args()
    reasons = preflight()
    if reasons:
        console.print(f"[red]cannot build the emulated cluster:[/] {'; '.join(reasons)}")
        return 2
    scenarios: tuple[Scenario, ...] = QUICK if args.quick else FULL
    if args.scenarios:
        wanted = {x.strip() for x in args.scenarios.split(",")}
        unknown = wanted - {s.name for s in ALL}
        if unknown:
            console.print(f"[red]error:[/] --scenarios: no scenario {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(s.name for s in ALL)})")
            return 2
        scenarios = tuple(s for s in ALL if s.name in wanted)
    if args.device == "model" and not args.scenarios and not args.quick:
        scenarios = MODEL
    args.cycles = args.cycles or (3 if args.quick else 4)
    try:
        if args.mps and args.device != "model":
            raise ValueError("--mps needs --device model")
        args.device_params = (DeviceParams(args.slice_us, 0.0 if args.mps else args.switch_us, args.interference)
                              if args.device == "model" else None)
    except ValueError as exc:
        console.print(f"[red]error:[/] device model: {exc}")
        return 2
    args.width = args.width or (512 if args.device == "model" else 1024)
    try:
        args.device_cores, args.job_env = host_cores_plan(args.host_cores, os.sched_getaffinity(0),
                                                          max(s.nodes for s in scenarios))
        # A rank that does not wait for grants (alone under a lease, or passthrough) would send its
        # phase reports a few at a time, and the daemon takes a phase no longer than it saw it:
        # batched, the alone compute phases the simulator is given came out up to 16 % short.
        args.job_env["CROSSOVER_REPORT_INTERVAL"] = "0"
    except (ValueError, SettingError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    args.segment_s = args.segment_s or max(5.0, 20 * args.iter_ms / 1000)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="xo-bench-")
    workdir = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    summaries, first_raw = [], None
    total = 2 + sum(args.cycles * len(_colocated(args)) + 2 for _ in scenarios)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("calibration", total=total)

        # Two rounds: a reference point, then the predicted 1:1 point (medians; the machine is shared).
        batch, rate, rounds = 256, args.ref_rate, []
        for k in range(2):
            progress.update(task, description=f"calibration {k + 1}/2 @ {rate:g} Mbit/s, batch {batch}")
            cal = calibrate(rate, batch, args, workdir / f"calibration{k}")
            rounds.append({key: (1000 * v if key in ("C", "M") else v) for key, v in cal.items()})
            c_per_sample, m_bits = cal["C"] / batch, cal["M"] * rate  # M ~ bytes / rate
            want = args.iter_ms / 2000
            batch = max(16, int(round(want / c_per_sample / 16)) * 16)
            rate = float(round(min(2000.0, max(20.0, m_bits / want))))
            progress.advance(task)
        calibration = {"rounds_ms": rounds, "params": cal["params"], "compute_ms_per_sample": 1000 * c_per_sample,
                       "allreduce_ms_at_200mbit": 1000 * m_bits / 200}
        progress.console.print(f"calibration: {cal['params']:,} parameters; allreduce {1000 * m_bits / 200:.0f} ms "
                               f"at 200 Mbit/s; compute {1000 * c_per_sample:.3f} ms/sample")
        for scn in scenarios:
            want_c = args.iter_ms / 1000 / (1 + scn.ratio)
            want_m = args.iter_ms / 1000 * scn.ratio / (1 + scn.ratio)
            batch = max(16, int(round(want_c / c_per_sample / 16)) * 16)
            rate = float(round(min(2000.0, max(20.0, m_bits / want_m))))

            def seg_step(what: str) -> None:
                progress.update(task, description=what)
                progress.advance(task)

            raw = run_scenario(scn, rate, batch, args, workdir / scn.name.replace(":", "-").replace(" ", "_"),
                               seg_step)
            summary = summarize(scn, raw)
            summaries.append(summary)
            first_raw = first_raw or raw
            xo = summary["modes"]["crossover"]
            progress.console.print(
                f"{scn.name}: crossover {xo['aggregate_samples_per_s']:.0f} samples/s = "
                f"{xo['vs_unscheduled']:.2f}× unscheduled, {xo['vs_sequential']:.2f}× sequential, "
                f"{100 * xo['of_bound']:.0f}% of bound (medians of {args.cycles} cycles)")

    device = ("1 core = 1 device per node" if args.device_params is None
              else f"emulated GPU per node: {args.device_params.describe()}")
    Console(width=None if sys.stdout.isatty() else 180).print(render(summaries, args.host_wait, args.nice, device))
    if first_raw is not None:
        s0 = summaries[0]
        plot_timeline(first_raw, args.timeline,
                      f"{s0['scenario']}: {s0['rate_mbit']:.0f} Mbit/s, batch {s0['batch']}, alone C "
                      f"{s0['alone_C_ms']:.0f} ms / M {s0['alone_M_ms']:.0f} ms, host wait {args.host_wait}, "
                      f"nice {args.nice} (first segment of each mode)", args.timeline_seconds)
        print(f"wrote {args.timeline}")
    for s in summaries:
        if s["targets"]:
            print(f"targets ({s['scenario']}): " + ", ".join(f"{k} {'MET' if v else 'MISSED'}"
                                                           for k, v in s["targets"].items()))
    write_json(args.out, {
        "benchmark": "crossover", "version": 2, "time": time.time(), "machine": machine(),
        "elapsed_s": time.monotonic() - t_start,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "device_params"},
        "setup": {"framework": args.framework, "host_wait": args.host_wait, "nice": args.nice,
                  "host_cores": args.host_cores,
                  "device": args.device,
                  "device_model": None if args.device_params is None else {
                      "slice_us": args.device_params.slice_us, "switch_us": args.device_params.switch_us,
                      "interference": args.device_params.interference,
                      "ms_per_sample": args.device_ms_per_sample},
                  "device_cores": list(args.device_cores), "cycles": args.cycles, "segment_s": args.segment_s,
                  "nodes": {s.name: s.nodes for s in scenarios},
                  "devices_per_node": 1, "ranks_per_job": 2, "workload": str(WORKLOAD.relative_to(ROOT)),
                  "unscheduled_policy": "passthrough",
                  "sequential": "solo runs of the first job (before) and the last job (after) the co-located run",
                  "note": (f"a node's device is one core; this machine has {machine()['cpus']}, so a 3-node "
                           f"scenario's nodes 0 and 2 share a core unless --host-cores leaves 3 device cores"
                           if args.device_params is None else
                           f"a node's device is an emulated GPU ({args.device_params.describe()}); "
                           f"{args.device_ms_per_sample:g} ms of device time per sample")},
        "calibration": calibration,
        "scenarios": summaries,
    })
    print(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0

