"""Where a benchmark's results go and what they record about the run: the checkout, the machine, the commit."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from tools.harness.jobs import CHECKOUT

__all__ = ["ROOT", "git_commit", "machine", "write_json"]

ROOT = CHECKOUT


def machine() -> dict[str, Any]:
    """The host, its CPU count, Python and platform: what a result file says it ran on."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def git_commit() -> str:
    """The checkout's short commit id, or "" where git cannot tell."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
