"""Calls the daemon ended with an error, by gRPC status code, over every way in.

One tally per process, like the process's own CPU and memory figures: every
place that turns an error into a status (the services, both session
transports, the rights gate) counts it here, and the metrics read it.
"""
from __future__ import annotations

import threading
from collections import Counter

import grpc

__all__ = ["count", "counts"]

_lock = threading.Lock()
_counts: Counter[str] = Counter()


def count(code: grpc.StatusCode) -> None:
    with _lock:
        _counts[code.name] += 1


def counts() -> dict[str, int]:
    """Errors so far, by status code name (`UNAUTHENTICATED`, ...)."""
    with _lock:
        return dict(_counts)
