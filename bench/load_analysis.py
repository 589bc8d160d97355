"""The load benchmark's arithmetic (`bench/load.py`): how sessions are dealt to worker processes and how
its figures come out of what the sessions saw and what the daemon's event log recorded."""
from __future__ import annotations

from crossover.protos.event_file import Event
from crossover.protos.event_records import Grant, Request

__all__ = ["Key", "grant_records", "leak_suspected", "lost_requests", "net_of_queueing", "split"]

Key = tuple[str, int]  # (job id, iteration): one compute request


def split(n: int, parts: int) -> list[list[int]]:
    """Indices 0..n-1 dealt round-robin into ``parts`` non-empty lists (fewer when n < parts)."""
    parts = max(1, min(parts, n))
    return [list(range(p, n, parts)) for p in range(parts)]


def net_of_queueing(client: dict[Key, float], daemon: dict[Key, float]) -> tuple[list[float], int]:
    """Client-measured waits minus the daemon's queue time of the same request; and how many had no grant record."""
    net = [wait - daemon[k] for k, wait in client.items() if k in daemon]
    return net, sum(1 for k in client if k not in daemon)


def lost_requests(requested: set[Key], granted: set[Key], refused_attached: set[Key]) -> set[Key]:
    """Requests the daemon logged but never granted, and acquires that returned False while attached."""
    return (requested - granted) | refused_attached


def leak_suspected(threads_after_close: list[int], sessions: int) -> bool:
    """Threads left after successive register+close waves of ``sessions`` sessions look like a leak: the last
    wave still added a thread for every fourth session or more (a pool that grows to its cap adds ever fewer)."""
    return len(threads_after_close) > 1 and threads_after_close[-1] - threads_after_close[-2] >= max(1, sessions / 4)


def grant_records(events: list[Event]) -> tuple[set[Key], dict[Key, float]]:
    """From an event log: the requests (job, iteration) and each grant's daemon-side queue time."""
    requested = {(str(e.job), Request.of(e).iteration) for e in events if e.name is Request.name}
    grants = [(str(e.job), Grant.of(e)) for e in events if e.name is Grant.name]
    granted = {(job, g.iteration): g.waited_s for job, g in grants}
    return requested, granted
