"""`bench.exchange_cost` on loopback with a small model, as CI runs it: every path (TCP with each codec, shared
memory) exchanges with a real service process and comes back with the global model, so the benchmark the
exchange figures come from cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from crossover.plugins.aggregation.group_async.shared_buffers import shared_memory_usable
from testbed.harness.jobs import CHECKOUT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_every_path_exchanges_with_a_real_service(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    res = subprocess.run([sys.executable, "-m", "bench.exchange_cost", "--sizes", "0.05", "--out", str(out)],
                         cwd=CHECKOUT, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    paths = {"bare tcp", "tcp fp32", "tcp fp16", "tcp topk 1%"}
    paths |= {"shared memory"} if shared_memory_usable() else set()
    assert {r["path"] for r in rows} == paths, rows
    assert all(r["params"] == 50_000 and r["repeats"] == 12 and 0 < r["exchange_ms_p50"] for r in rows), rows
