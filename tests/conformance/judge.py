"""What the conformance tier shares: Horovod's own suite beside the checkout, the placements a
2-rank job is run in, and how a co-located run is judged and recorded."""
from __future__ import annotations

import json
import os
from typing import Any

from tools.harness.jobs import CHECKOUT
from tools.harness.oracles import compute_intervals, overlaps

CONFORMANCE_RESULTS = CHECKOUT / "results" / "conformance.json"
# Horovod 0.28.1's own tests and examples, beside the checkout (CI has shared/ there); run from there, never copied.
PEER = CHECKOUT.parent / "shared" / "peer" / "horovod-0.28.1"
WITH_CROSSOVER = CHECKOUT / "tests" / "conformance" / "with_crossover.py"  # runs a script with the import added
# The two placements of a 2-rank job: crossoverd --cpu-devices per placement.
PLACEMENTS = {"rank-per-device": "2", "ranks-share-device": "1"}


def record_conformance(row: dict[str, Any]) -> None:
    """Append a conformance row to `results/conformance.json` (one per pair and placement; the newest wins)."""
    CONFORMANCE_RESULTS.parent.mkdir(exist_ok=True)
    rows = json.loads(CONFORMANCE_RESULTS.read_text()) if CONFORMANCE_RESULTS.exists() else []
    rows = [r for r in rows if (r["pair"], r["placement"]) != (row["pair"], row["placement"])] + [row]
    CONFORMANCE_RESULTS.write_text(json.dumps(rows, indent=1) + os.linesep)


def judge_colocated_run(label: str, policy: str, run: dict[str, Any], base: dict[str, Any],
                        row: dict[str, Any]) -> None:
    """A co-located pair under a blocking policy, against the same pair under `passthrough`.

    The daemon granted devices, no compute phases overlapped on a device, no holder was
    `overdue`, and the pair took at most 2x its unscheduled time. Adds the policy's wall
    time, ratio and yields to `row` (a `results/conformance.json` row).
    """
    events = run["events"]
    per_dev = compute_intervals(events)
    assert per_dev, f"{label}: the daemon granted nothing"
    for dev, intervals in per_dev.items():
        assert overlaps(intervals) == [], f"{label}: compute phases overlap on device {dev}"
    overdue = [e for e in events if e["event"] == "overdue"]
    assert overdue == [], f"{label}: a holder stalled while holding its device: {overdue[:3]}"
    ratio = run["wall_s"] / base["wall_s"]
    row[f"{policy}_s"] = round(run["wall_s"], 2)
    row[f"{policy}_ratio"] = round(ratio, 2)
    row[f"{policy}_yields"] = run["yields"]
    assert ratio <= 2.0, f"{label}: {run['wall_s']:.1f}s against {base['wall_s']:.1f}s unscheduled ({ratio:.2f}x)"
