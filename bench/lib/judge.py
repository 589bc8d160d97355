"""Judging a benchmark's numbers: the statistics they are summed up with, and the table of its checks."""
from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table

from crossover.figures import percentile

__all__ = ["mean", "percentile", "verdicts"]


def mean(xs: list[float]) -> float:
    """The arithmetic mean; NaN for no values."""
    return statistics.fmean(xs) if xs else float("nan")


def verdicts(checks: list[dict[str, Any]], title: str = "Targets") -> Table:
    """Checks (``check``, ``value``, ``met``) as a table: met, not met, or reported only (``met`` None: —)."""
    out = Table(title=title)
    for column in ("check", "value", "met"):
        out.add_column(column)
    for row in checks:
        met = "—" if row["met"] is None else "yes" if row["met"] else "[red]NO[/red]"
        out.add_row(row["check"], row["value"], met)
    return out
