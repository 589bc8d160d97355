"""Checks read from a daemon's event log: who held each device when, and whether two jobs' compute
phases overlapped on a device."""
from __future__ import annotations

from crossover.protos.event_phases import Events, read_phases

__all__ = ["compute_intervals", "overlaps"]


def compute_intervals(events: Events) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per device, the [grant, release) intervals of one node's event log, as `crossover.protos.event_phases`
    reads them: (start, end, job id, rank).

    An `overdue` holder's interval ends where the daemon gave its device to the next rank, a suspended
    one's where it fell silent.
    """
    out: dict[int, list[tuple[float, float, str, int]]] = {}
    for iv in read_phases(events).intervals:
        if iv.phase == "compute":
            out.setdefault(iv.device, []).append((iv.start, iv.end, iv.job, iv.rank))
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
