"""The event log's file: one JSON object per line, as `crossoverd --event-log` writes it.

The daemon writes it (`crossover.daemon.event_log`); the CLI (`crossover stats`,
`timeline`), the benchmarks and the test beds read it. The fields of each event
are listed in docs/operating.md.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl"]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Load an event log file; a torn last line (the daemon was writing it) is skipped."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
