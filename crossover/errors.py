"""The root of every error Crossover raises on purpose, for daemon, client and plugin alike.

Each error also derives from the built-in it behaves as (`ValueError` for bad input,
`ConnectionError` for a broken link, ...), so callers that catch those keep working; code that
wants "anything Crossover refused" catches `CrossoverError`. The daemon's request errors, and the
gRPC status each travels as, are in `crossover.daemon.api`.
"""
from __future__ import annotations

__all__ = ["CrossoverError"]


class CrossoverError(Exception):
    """Base class of every error Crossover raises on purpose."""
