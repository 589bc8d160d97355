"""Shared plumbing for benchmarks: real daemons, real horovodrun jobs, result files."""
from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKLOAD = ROOT / "tests" / "workloads" / "train_mlp.py"


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


class Daemon:
    def __init__(self, workdir: Path, *args: str, name: str = "d", nice: int = 0) -> None:
        self.socket = workdir / f"{name}.sock"
        self.events = workdir / f"{name}.events.jsonl"
        self.log = workdir / f"{name}.log"
        prefix = ["nice", "-n", str(nice)] if nice else []
        self.proc = subprocess.Popen(
            [*prefix, str(BIN / "crossoverd"), "--socket", str(self.socket), "--event-log", str(self.events),
             "--log-level", "WARNING", *args],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"crossoverd failed: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def script_with_import(workdir: Path, src: Path = WORKLOAD) -> Path:
    out = workdir / f"xo_{src.name}"
    out.write_text("import crossover.auto\n" + src.read_text())
    return out


def start_job(name: str, script: Path, workdir: Path, np: int, args: list[str], env: dict[str, str]
              ) -> tuple[subprocess.Popen, Path]:
    out = workdir / f"out_{name}"
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, str(script),
           "--out", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=open(workdir / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "CROSSOVER_JOB_NAME": name, **env}, start_new_session=True)
    return proc, out


def finish_job(proc: subprocess.Popen, out: Path, timeout: float = 600) -> list[dict[str, Any]]:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if rc != 0:
        raise RuntimeError(f"job failed ({rc}); see {out.parent}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
