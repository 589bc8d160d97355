"""Judging a benchmark's numbers: the statistics they are summed up with, and the table of its checks."""
from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table

__all__ = ["mean", "percentile", "verdicts"]


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile by nearest rank; NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


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
