"""Every DDP pattern of issue 53 beside itself: two co-located 2-rank `torchrun` jobs, each policy, 1 and 2 devices.

For each pattern of `testbed/workloads/train_ddp.py`, under `exclusive` and `crossover`,
on one and on two `--cpu-devices` of a real crossoverd, two jobs of that pattern with
`import crossover.auto` train side by side (Gloo). A pair passes when:

  * both jobs finish (a rank's Gloo abort at exit after it wrote its results counts as
    finished and is counted apart), their ranks agree, and no rank trained unscheduled;
  * both registered as DDP, and each got a grant for at least every iteration;
  * every device served both jobs, and under `exclusive` no two jobs' compute phases overlapped.

    python -m bench.ddp_patterns [--iters 40] [--patterns plain,zero] [--out results/ddp_patterns.json]

The test tier (`tests/multiprocess/test_ddp_jobs.py`) runs each pattern once, beside another.
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.lib.results import machine, write_json
from crossover.protos.event_records import Grant, Register
from testbed.harness.daemon import DaemonProc
from testbed.harness.jobs import Job, exit_outcome, torchrun, with_import
from testbed.harness.oracles import compute_intervals, overlaps
from testbed.workloads.train_ddp import PATTERNS


def _job_outcome(job: Job, timeout: float) -> dict[str, Any]:
    outcome = exit_outcome(job, timeout)
    digests = {s["digest"] for s in job.summaries()}
    return {"rc": job.proc.returncode, "finished": outcome != "failed", "abort_at_exit": outcome == "abort at exit",
            "ranks_agree": len(digests) == 1, "unscheduled": "unscheduled" in job.output()}


def run_pair(pattern: str, policy: str, devices: int, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Two jobs of ``pattern`` on one daemon; what each did and what the daemon's log shows."""
    where = workdir / f"{pattern}-{policy}-{devices}"
    where.mkdir(parents=True)
    script = with_import(where, "train_ddp.py")
    with DaemonProc.in_dir(where, "--cpu-devices", str(devices), "--policy", policy) as d:
        env = {"CROSSOVER_SOCKET": str(d.socket)}
        jobs = [torchrun(side, script, where, args=("--pattern", pattern, "--iters", str(args.iters)), env=env)
                for side in ("left", "right")]
        outcomes = {job.name: _job_outcome(job, args.timeout) for job in jobs}
        events = d.events()
    grants = collections.Counter(e.job_name for e in events if e.name is Grant.name)
    frameworks = {e.job_name: Register.of(e).framework for e in events if e.name is Register.name}
    per_dev = compute_intervals(events)
    served = len(per_dev) == devices and all(len({iv[2] for iv in ivs}) == 2 for ivs in per_dev.values())
    overlapping = sum(len(overlaps(ivs)) for ivs in per_dev.values())
    checks = {
        "finished": all(o["finished"] and o["ranks_agree"] and not o["unscheduled"] for o in outcomes.values()),
        "registered_as_ddp": frameworks == {"left": "ddp", "right": "ddp"},
        "granted_every_iteration": all(grants[name] >= args.iters for name in ("left", "right")),
        "every_device_served_both": served,
        "exclusive_never_overlaps": policy != "exclusive" or overlapping == 0,
    }
    return {"pattern": pattern, "policy": policy, "devices": devices, "ok": all(checks.values()), "checks": checks,
            "grants": dict(grants), "aborts_at_exit": sum(o["abort_at_exit"] for o in outcomes.values()),
            "jobs": outcomes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated, from: " + ", ".join(PATTERNS))
    p.add_argument("--timeout", type=float, default=200.0, help="seconds a job may take")
    p.add_argument("--out", type=Path, default=Path("results/ddp_patterns.json"))
    args = p.parse_args()
    patterns = [x.strip() for x in args.patterns.split(",") if x.strip()]
    unknown = sorted(set(patterns) - set(PATTERNS))
    if unknown:
        p.error(f"--patterns: unknown {', '.join(unknown)} (known: {', '.join(PATTERNS)})")
    combos = [(pat, pol, dev) for pat in patterns for pol in ("exclusive", "crossover") for dev in (1, 2)]
    pairs = []
    with tempfile.TemporaryDirectory(prefix="xo-ddp-") as tmp, Progress(transient=True) as progress:
        task = progress.add_task("pairs", total=len(combos))
        for pat, pol, dev in combos:
            progress.update(task, description=f"{pat}, {pol}, {dev} device(s)")
            pairs.append(run_pair(pat, pol, dev, Path(tmp), args))
            progress.advance(task)
    table = Table(title=f"DDP patterns, two co-located 2-rank torchrun jobs each, {args.iters} iterations")
    for col in ("pattern", "policy", "devices", "result", "grants left/right", "aborts at exit", "failed checks"):
        table.add_column(col)
    for r in pairs:
        failed = [k for k, v in r["checks"].items() if not v]
        table.add_row(r["pattern"], r["policy"], str(r["devices"]), "ok" if r["ok"] else "FAILED",
                      f"{r['grants'].get('left', 0)}/{r['grants'].get('right', 0)}", str(r["aborts_at_exit"]),
                      ", ".join(failed) or "-")
    console = Console()
    console.print(table)
    passed = sum(r["ok"] for r in pairs)
    console.print(f"{passed} of {len(pairs)} pairs passed")
    write_json(args.out, {"benchmark": "ddp_patterns", "time": time.time(), "machine": machine(),
                          "args": {"iters": args.iters, "patterns": patterns}, "passed": passed,
                          "pairs": pairs})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
