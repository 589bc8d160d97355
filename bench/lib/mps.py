"""NVIDIA's MPS control daemon for one benchmark run, in the run's own folders, stopped on every exit path.

MPS lets the kernels of several processes run on one GPU at once instead of
time-slicing their contexts. A client process joins the control daemon whose
pipe folder its `CUDA_MPS_PIPE_DIRECTORY` names, so a run that starts its own
daemon with its own folders touches neither the machine's MPS daemon (if any)
nor the GPU's settings (no compute-mode change: MPS does not need one).
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType

__all__ = ["MpsDaemon", "MpsError"]


class MpsError(RuntimeError):
    """The control daemon could not be started (or is missing)."""


class MpsDaemon:
    """`nvidia-cuda-mps-control -d` with pipe and log folders under `workdir`; `env()` is what clients need."""

    def __init__(self, workdir: Path, binary: str = "nvidia-cuda-mps-control") -> None:
        self.pipe_dir = workdir / "mps-pipe"
        self.log_dir = workdir / "mps-log"
        self.binary = binary
        self.running = False
        self._old_term: object = None

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def start(self) -> MpsDaemon:
        path = shutil.which(self.binary)
        if path is None:
            raise MpsError(f"{self.binary} is not on PATH: MPS needs NVIDIA's driver utilities")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([path, "-d"], env={**os.environ, **self.env()}, capture_output=True, text=True,
                             timeout=30)
        if res.returncode != 0:
            raise MpsError(f"{self.binary} -d exited {res.returncode}: {(res.stdout + res.stderr).strip()[:500]}")
        self.running = True
        atexit.register(self.stop)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        deadline = time.monotonic() + 10
        while not (self.pipe_dir / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.stop()
        raise SystemExit(128 + signum)

    def stop(self) -> None:
        """Tell the control daemon to quit (it stops its server once no client is left); idempotent."""
        if not self.running:
            return
        self.running = False
        try:
            subprocess.run([self.binary], input="quit\n", env={**os.environ, **self.env()}, capture_output=True,
                           text=True, timeout=30)
        finally:
            if callable(self._old_term) or self._old_term in (signal.SIG_DFL, signal.SIG_IGN):
                signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
