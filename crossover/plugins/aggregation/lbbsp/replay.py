"""Replaying a run's shared measurements offline: the sizes the plugin would adopt from them."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from crossover.plugins.aggregation.lbbsp.adoption import decide
from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.lbbsp.exchange import observe_steps, share_read_after, share_starts

__all__ = ["replay_decisions"]


def replay_decisions(config: BatchSizeConfig, trace: Sequence[Sequence[Sequence[float]]],
                     initial_sizes: Optional[Sequence[int]] = None,
                     min_gain: float = 0.1) -> list[tuple[int, list[int]]]:
    """The size history a job would adopt from ``trace`` (``lbbsp_stats()["trace"]``).

    Feeds the recorded measurements to a fresh controller on the plugin's own
    schedule (exchange after each period, read ``SHARE_LAG`` steps later) and
    adopts with :func:`decide`, so with the recorded settings it reproduces
    the recorded ``history``; with other settings it answers "what would this
    rule have done on that run". Returns ``[(first step, sizes), ...]``.
    """
    controller = BatchSizeController(config, initial_sizes)
    sizes = list(controller.sizes)
    history = [(0, list(sizes))]

    def read(shared: list[Sequence[Sequence[float]]], iteration: int) -> None:
        nonlocal sizes
        observe_steps(controller, shared)
        adopted = decide(controller, sizes, min_gain)
        if adopted is not None:
            sizes = adopted
            history.append((iteration + 1, list(adopted)))

    chunk: list[Sequence[Sequence[float]]] = []
    shared: Optional[list[Sequence[Sequence[float]]]] = None
    started = 0
    for iteration, row in enumerate(trace):
        chunk.append(row)
        if shared is not None and iteration >= share_read_after(started, config.period):
            read(shared, iteration)
            shared = None
        if share_starts(iteration, config.period):
            shared, chunk, started = chunk, [], iteration
    if shared is not None:  # the trace holds only exchanges that were read: this one was, after its end
        read(shared, share_read_after(started, config.period))
    return history
