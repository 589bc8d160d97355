"""`bench.gpu --dry-run --only memory`, as CI runs it: the memory benchmark's four runs on the emulated device, so
that the GPU run of the next draw cannot rot, and what they show on the CPU bed holds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.harness.jobs import CHECKOUT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def test_the_memory_runs_show_today_and_the_reservation(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run", "--only", "memory", "--out",
                          str(tmp_path / "out"), "--workdir", str(tmp_path / "wd")], cwd=CHECKOUT,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    check = json.loads((tmp_path / "out" / "gpu.json").read_text())["checks"]["memory"]
    arms = check["arms"]
    assert check["ok"] and check["production_survived"] and check["low_told"], check
    assert arms["today"]["prod"]["outcome"] == "oom", "without Crossover the production job's spike should not fit"
    assert arms["reserved"]["low"]["oom_iteration"] <= 8
    assert "crossoverd --reserve" in arms["reserved"]["low"]["crossover_line"]
    assert arms["reserved-fits"]["low"]["outcome"] == "ok" and arms["reserved-fits"]["prod"]["spiked"]
    caps = {e["cap_bytes"] for e in arms["reserved"]["memory_events"] if e["event"] == "memory_cap"}
    total = arms["reserved"]["prod"]["total"]
    assert total - int(0.7 * total) in caps
