"""Where a benchmark's results go and what they record about the run: the checkout, the machine, the commit."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from testbed.harness.jobs import CHECKOUT

__all__ = ["ROOT", "git_commit", "machine", "portable", "write_json"]

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


_SCRATCH = re.compile(r"/(?:tmp|var/tmp|dev/shm)/[^\s\"',:;)\\]*")


def portable(text: str) -> str:
    """`text` without the paths of the machine that wrote it: the checkout becomes `.`, a scratch file
    (/tmp, /dev/shm) `<tmp>`, a home folder `~`. A result file then says the same on every machine."""
    text = text.replace(str(ROOT), ".")
    text = _SCRATCH.sub("<tmp>", text)
    return re.sub(r"/(?:home/[^/\s\"\\]+|root)(?=/)", "~", text)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating the folder; paths of this machine are made `portable`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(portable(json.dumps(data, indent=2)))
