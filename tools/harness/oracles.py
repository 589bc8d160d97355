"""Checks read from a daemon's event log: who held each device when, and whether two jobs' compute
phases overlapped on a device."""
from __future__ import annotations

from typing import Any

__all__ = ["compute_intervals", "overlaps"]


def compute_intervals(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per device, the [grant, release) intervals from the event log.

    An `overdue` holder's interval ends where the daemon gave its device to the next rank.
    """
    open_: dict[tuple[Any, Any], tuple[float, int]] = {}
    out: dict[int, list[tuple[float, float, str, int]]] = {}
    for e in events:
        key = (e.get("job"), e.get("rank"))
        if e["event"] == "grant":
            open_[key] = (e["t"], e["device"])
        elif e["event"] in ("release", "leave", "overdue") and key in open_:
            t0, dev = open_.pop(key)
            out.setdefault(dev, []).append((t0, e["t"], key[0], key[1]))
    return out


def overlaps(intervals: list[tuple[float, float, str, int]]) -> list[tuple]:
    """Pairs of intervals of different jobs (earlier start first) where the later one starts before the
    earlier one ends. A job's own ranks on one device compute together (`DeviceQueues.mates`)."""
    found: list[tuple] = []
    running: list[tuple[float, float, str, int]] = []
    for iv in sorted(intervals):
        running = [r for r in running if r[1] > iv[0]]
        found += [(r, iv) for r in running if r[2] != iv[2]]
        running.append(iv)
    return found
