"""`bench.gpu --only memory`: a production job whose memory takes most of the GPU, beside a low job that tries to
take more than what is left, with and without Crossover's reservations (issue 54).

Every job is a one-rank DDP job (`testbed/workloads/train_memory.py`, `torchrun`), its memory set in shares of
the device. The production job holds `PROD_BASE` and needs `PROD_ACT` more in each iteration; once the low job
has grown as far as it gets, the production job needs `PROD_SPIKE` more in one iteration (a longer batch).
The low job grows by `LOW_GROW` an iteration up to a target. Four runs:

* `alone`: the production job alone: its iteration time is the reference;
* `today`: both jobs, no Crossover: the low job grows to `LOW_TARGET`, and the production job's spike no
  longer fits: what happens today;
* `reserved`: both jobs under a daemon with `--reserve high=RESERVE`: the low job is capped below what the
  production job needs, and stops at its cap with the line;
* `reserved-fits`: the same daemon, the low job growing only to `LOW_FITS`, under its cap: both train, and
  the production job's speed beside it is measured against alone;
* `spill` (GPU only, where `nvcc` builds `managed_alloc.cu`): as `reserved`, but every allocation of the low
  job is managed memory (torch's `CUDAPluggableAllocator`), which its cap cannot limit and the driver can
  move to the host: whether the production job's spike still fits (the driver evicting the low job's pages)
  and what the low job's speed is then, beside the hard cap's line.

The dry run takes the same steps on the emulated device (`testbed.device_model`) of `DRY_TOTAL_MB`, with
`--cpu-devices 1 --cpu-device-memory`, so CI keeps the benchmark whole between GPU draws.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from crossover.protos.event_file import read_jsonl
from testbed import checkout_on_path
from testbed.harness.daemon import kill_group
from testbed.harness.jobs import WORKLOADS, with_import
from testbed.harness.polling import wait_until

__all__ = ["check_memory"]

PROD_BASE, PROD_ACT, PROD_SPIKE = 0.45, 0.05, 0.15
LOW_GROW, LOW_TARGET, LOW_FITS = 0.05, 0.40, 0.10
RESERVE = 0.70
DRY_TOTAL_MB, DRY_CONTEXT_MB = 4096, 50
_ARMS = ("alone", "today", "reserved", "reserved-fits", "spill")


def _log(msg: str) -> None:
    print(f"[bench.gpu memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Run:
    """One arm's jobs and files in `workdir/ARM`."""

    def __init__(self, workdir: Path, arm: str, env: dict[str, str], dry: bool) -> None:
        self.dir = workdir / arm
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.dry = dry
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spike, self.stop = self.dir / "spike", self.dir / "stop"

    def start(self, name: str, script: Path, extra: dict[str, str], *args: str) -> None:
        env = {**os.environ, **self.env, **extra, "CROSSOVER_JOB_NAME": name, "PYTHONUNBUFFERED": "1",
               "CROSSOVER_LOG_LEVEL": "INFO"}
        env["PYTHONPATH"] = checkout_on_path(env)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script),
               "--out", str(self.dir / f"{name}.json"), "--stop-file", str(self.stop), *args,
               *(["--total-mb", str(DRY_TOTAL_MB), "--width", "64"] if self.dry else [])]
        with open(self.dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def progress(self, name: str) -> tuple[int, bool]:
        try:
            words = (self.dir / f"{name}.progress").read_text().split()
        except (FileNotFoundError, ValueError):
            return 0, False
        return (int(words[0]) if words else 0), "grown" in words

    def wait(self, what: str, check: Any, timeout: float) -> None:
        wait_until(check, timeout, f"{what} (logs in {self.dir})", interval=0.1)

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def finish(self, timeout: float) -> dict[str, Any]:
        self.stop.touch()
        out: dict[str, Any] = {}
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait()
            path = self.dir / f"{name}.json"
            summary = json.loads(path.read_text()) if path.exists() else {"outcome": "no summary"}
            log = (self.dir / f"{name}.log").read_text(errors="replace")
            measured = [ln.split("crossover: ", 1)[1] for ln in log.splitlines() if "outside its allocator" in ln]
            out[name] = {"exit": proc.returncode, "cap_applied": measured[-1:], "outcome": summary.get("outcome"),
                         "oom_iteration": summary.get("iteration"), "spiked": summary.get("spiked"),
                         "iterations": len(summary.get("starts", [])),
                         "iteration_s": _median_iteration(summary), "peak_reserved": summary.get("peak_reserved"),
                         "total": summary.get("total"),
                         "crossover_line": next((ln.split("crossover: ", 1)[1] for ln in log.splitlines()
                                                 if "ran out of its memory cap" in ln), "")}
        return out


def _median_iteration(summary: dict[str, Any]) -> float | None:
    spans = [e - s for s, e in zip(summary.get("starts", []), summary.get("ends", []))][2:]
    return round(statistics.median(spans), 5) if spans else None


def _managed_allocator(workdir: Path) -> Path | str:
    """`managed_alloc.cu` built with nvcc; the reason as text where it cannot be."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "no nvcc on this machine"
    lib = workdir / "managed_alloc.so"
    res = subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                          str(Path(__file__).with_name("managed_alloc.cu"))], capture_output=True, text=True)
    return lib if res.returncode == 0 else f"nvcc failed: {res.stderr[-500:]}"


def _arm(arm: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from bench.gpu.cli import _Daemon  # the benchmark's own daemon helper

    managed: list[str] = []
    if arm == "spill":
        lib = "the dry run has no CUDA" if args.dry_run else _managed_allocator(workdir)
        if not isinstance(lib, Path):
            return {"skipped": lib}
        managed = ["--managed-alloc", str(lib)]

    dry = args.dry_run
    env: dict[str, str] = {}
    daemon = None
    device = None
    if dry:
        device = subprocess.Popen([sys.executable, "-m", "testbed.device_model.server", "--socket",
                                   str(workdir / f"{arm}.dev.sock"), "--memory-mb", str(DRY_TOTAL_MB),
                                   "--context-mb", str(DRY_CONTEXT_MB)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        env["EMULATED_DEVICE_SOCKET"] = str(workdir / f"{arm}.dev.sock")
        wait_until((workdir / f"{arm}.dev.sock").exists, 20, "the emulated device's socket")
    run = _Run(workdir, arm, env, dry)
    try:
        scheduled = arm.startswith("reserved") or arm == "spill"
        if scheduled:
            extra = ["--cpu-devices", "1", "--cpu-device-memory", f"{DRY_TOTAL_MB}MiB"] if dry else []
            daemon = _Daemon(run.dir, *extra, "--reserve", f"high={100 * RESERVE:g}%",
                             "--class-rule", f"uid:{os.getuid()}=high")
            env["CROSSOVER_SOCKET"] = str(daemon.socket)
        script = with_import(run.dir, WORKLOADS / "train_memory.py") if scheduled else WORKLOADS / "train_memory.py"
        run.start("prod", script, {}, "--base", str(PROD_BASE), "--act", str(PROD_ACT), "--spike", str(PROD_SPIKE),
                  "--spike-file", str(run.spike))
        run.wait("the production job's first iterations", lambda: run.progress("prod")[0] >= 5 or
                 not run.running("prod"), args.job_timeout)
        if arm != "alone":
            target = LOW_FITS if arm == "reserved-fits" else LOW_TARGET
            run.start("low", script, {"CROSSOVER_PRIORITY": "low"}, "--grow", str(LOW_GROW), "--target",
                      str(target), "--act", "0.01", *managed)
            run.wait("the low job to grow or end", lambda: run.progress("low")[1] or not run.running("low")
                     or not run.running("prod"), args.job_timeout)
            at = run.progress("low")[0]
            run.wait("the low job's next iterations", lambda: run.progress("low")[0] >= at + 3
                     or not run.running("low") or not run.running("prod"), args.job_timeout)
        run.spike.touch()
        at = run.progress("prod")[0]
        run.wait("the production job's spike and later iterations",
                 lambda: run.progress("prod")[0] >= at + args.warmup or not run.running("prod"), args.job_timeout)
        result = run.finish(30)
    finally:
        for proc in run.procs.values():
            if proc.poll() is None:
                kill_group(proc)
        if daemon is not None:
            events = read_jsonl(daemon.events) if daemon.events.exists() else []
            result_events = [e for e in events if e.get("event", "").startswith("memory_cap")]
            daemon.close()
        if device is not None:
            kill_group(device)
            device.wait()
    if daemon is not None:
        result["memory_events"] = result_events[-20:]
    return result


def check_memory(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The four runs and what they show; `ok` when the production job survived every reserved run, the low job
    stopped with the line where it grew past its cap, and (on a GPU) the production job kept 0.95x its speed
    beside a low job within its cap."""
    arms: dict[str, Any] = {}
    for arm in _ARMS:
        _log(f"{arm} ...")
        arms[arm] = _arm(arm, args, workdir)
        if "skipped" in arms[arm]:
            _log(f"{arm}: skipped ({arms[arm]['skipped']})")
            continue
        jobs = {k: v for k, v in arms[arm].items() if k != "memory_events"}
        _log(f"{arm}: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "crossover_line"}
                                      for k, v in jobs.items()}))
    alone = arms["alone"]["prod"]["iteration_s"]
    beside = arms["reserved-fits"]["prod"]["iteration_s"]
    kept = round(alone / beside, 3) if alone and beside else None
    prod_ok = all(arms[a]["prod"]["outcome"] == "ok" and arms[a]["prod"]["spiked"]
                  for a in ("reserved", "reserved-fits"))
    low_told = arms["reserved"]["low"]["outcome"] == "oom" and bool(arms["reserved"]["low"]["crossover_line"])
    return {"arms": arms, "production_kept": kept, "production_survived": prod_ok, "low_told": low_told,
            "today": {"prod": arms["today"]["prod"]["outcome"], "low": arms["today"]["low"]["outcome"]},
            "low_fits_kept_training": arms["reserved-fits"]["low"]["outcome"] == "ok",
            "spill": arms["spill"] if "skipped" in arms["spill"] else {
                "prod": arms["spill"]["prod"]["outcome"], "low": arms["spill"]["low"]["outcome"],
                "low_iteration_s": arms["spill"]["low"]["iteration_s"],
                "low_iteration_s_capped": arms["reserved-fits"]["low"]["iteration_s"]},
            "shares": {"prod_base": PROD_BASE, "prod_act": PROD_ACT, "prod_spike": PROD_SPIKE,
                       "low_grow": LOW_GROW, "low_target": LOW_TARGET, "low_fits": LOW_FITS, "reserve": RESERVE},
            "ok": prod_ok and low_told and (args.dry_run or (kept or 0) >= 0.95)}
