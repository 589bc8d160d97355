"""The stop file a test uses to end a multi-rank workload early, every rank at the same step.

The test writes the iteration to stop before (`request_stop`); the ranks read it at the top of every
iteration (`stop_before`). Rank 0 publishes how far it got every `PUBLISH_EVERY` iterations
(`publish_progress`, to `FILE.at`), so the test can name an iteration that every rank reaches only
after the file is there. An empty file means "at once" (one-rank jobs only).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PUBLISH_EVERY", "publish_progress", "request_stop", "stop_before"]

PUBLISH_EVERY = 10


def _progress_path(stop_file: str | Path) -> Path:
    return Path(f"{stop_file}.at")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader sees the old text or the new, never a part


def stop_before(stop_file: str, iteration: int) -> bool:
    """Whether the stop file says to stop before `iteration` (empty: at once)."""
    try:
        text = Path(stop_file).read_text().strip()
    except FileNotFoundError:
        return False
    return iteration >= int(text) if text else True


def publish_progress(stop_file: str, iteration: int) -> None:
    """Rank 0, at the top of `iteration`: record it every `PUBLISH_EVERY` iterations."""
    if iteration % PUBLISH_EVERY == 0:
        _write(_progress_path(stop_file), str(iteration))


def request_stop(stop_file: Path, ahead: int) -> int:
    """Ask the ranks to stop `ahead` iterations past rank 0's last published progress (0 before any);
    returns that iteration. `ahead` > `PUBLISH_EVERY` leaves every rank time to read it first."""
    try:
        at = int(_progress_path(stop_file).read_text())
    except (FileNotFoundError, ValueError):
        at = 0
    _write(stop_file, str(at + ahead))
    return at + ahead
