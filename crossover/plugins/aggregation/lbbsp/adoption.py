"""The one rule that adopts a controller's proposal as the new per-rank batch sizes.

Two tests, the second optional:

1. size hysteresis: some rank's size moves by more than
   ``max(1, hysteresis × its size)`` samples;
2. with a ``min_gain``, a promised gain: the predicted iteration time (the
   slowest rank's predicted compute time) drops by at least ``min_gain`` even
   with cautious predictions (see :func:`adopt`).

:meth:`BatchSizeController.update <crossover.plugins.aggregation.lbbsp.controller.BatchSizeController.update>`
applies the hysteresis alone (``min_gain=None``); the weighted optimizer and
:func:`~crossover.plugins.aggregation.lbbsp.replay.replay_decisions` apply both
(:func:`decide`). Pure: every rank gets the same answer from the same estimates.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol

from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig

__all__ = ["adopt", "decide"]


class _Controller(Protocol):
    """What the rule reads of a controller (`crossover.plugins.aggregation.lbbsp.controller.BatchSizeController`)."""

    @property
    def config(self) -> BatchSizeConfig: ...

    def propose(self) -> Optional[list[int]]: ...

    def predicted_times(self, sizes: Sequence[int]) -> Optional[list[float]]: ...

    def prediction_errors(self) -> Optional[list[float]]: ...


def decide(controller: _Controller, current: Sequence[int], min_gain: float) -> Optional[list[int]]:
    """The sizes to adopt at a period boundary, or ``None`` to keep ``current``: the controller's
    proposal judged by :func:`adopt` with both tests."""
    return adopt(controller, controller.propose(), current, min_gain)


def adopt(controller: _Controller, proposal: Optional[Sequence[int]], current: Sequence[int],
          min_gain: Optional[float]) -> Optional[list[int]]:
    """``proposal`` as a list when it is adopted over ``current``, else ``None``.

    Adopts only when (1) some rank's size moves by more than
    ``max(1, hysteresis × its size)`` (the controller's hysteresis) and, unless
    ``min_gain`` is ``None``, (2) the predicted iteration time drops by at least
    ``min_gain`` even with cautious predictions (3): each rank's current time
    lowered and its new time raised by how far its prediction may be off (the
    bias and standard error of its recent times around its model, both robust
    to one-step hiccups, see :meth:`BatchSizeController.prediction_errors`).
    Rules 2 and 3 keep a homogeneous job from chasing measurement noise: with
    equal true speeds every noisy re-split makes the real slowest rank slower,
    so a re-split must promise a gain the measurements can vouch for.

    One exception to 2: when one rank is clearly the slowest (its current
    time lowered by its error exceeds every other rank's raised by theirs by
    ``min_gain``) and the proposal takes samples from it, its own new time is
    not asked to vouch for the gain: only the other ranks' cautious new times
    must stay ``min_gain`` below its cautious current time. Giving samples
    away never makes it slower, so with the others below it the move cannot
    lengthen the iteration; and its model is least trustworthy exactly
    there, below the batch sizes it has run (the ``ema`` line underrates how
    much faster a CPU straggler gets).
    """
    if proposal is None:
        return None
    hysteresis = controller.config.hysteresis
    if not any(abs(new - old) > max(1.0, hysteresis * old) for new, old in zip(proposal, current)):
        return None
    if min_gain is not None and not _promises_gain(controller, proposal, current, min_gain):
        return None
    return list(proposal)


def _promises_gain(controller: _Controller, proposal: Sequence[int], current: Sequence[int],
                   min_gain: float) -> bool:
    now, then = controller.predicted_times(current), controller.predicted_times(proposal)
    errors = controller.prediction_errors()
    if now is None or then is None or max(then) <= 0:
        return False
    if errors is not None:
        # Each rank's current time as short as one standard error of its own scatter
        # allows, its new time as long (the same relative error): equal ranks that only
        # look unequal then promise nothing, while a straggler far above its own scatter
        # still moves.
        then = [t * (1.0 + e / n) for t, e, n in zip(then, errors, now)]
        high_now = [t + e for t, e in zip(now, errors)]
        now = [t - e for t, e in zip(now, errors)]
        slowest = max(range(len(now)), key=lambda r: (now[r], -r))
        others = [r for r in range(len(now)) if r != slowest]
        if others and proposal[slowest] < current[slowest] and \
                now[slowest] >= (1.0 + min_gain) * max(high_now[r] for r in others):
            then = [then[r] for r in others]
    return max(now) >= (1.0 + min_gain) * max(then)
