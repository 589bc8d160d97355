"""How often groups exchange and how far apart they may drift: fixed, or staged (ASHL).

``fixed``: after the profiling steps, every epoch uses the configured period
and bound. ``staged``: the profiling steps run fully synchronous (one group
of every rank), then a coarse stage (4x the period, 2x the bound: infrequent
exchanges, a loose bound, to get close fast) until the global model's
progress flattens, then a fine stage (the configured period and bound) to
converge carefully. The switch criterion is read at epoch boundaries from
the size of the global model's change over the last epoch: once it falls
below ``plateau`` times the largest change seen, the coarse stage is over.
Pure logic: the sampler feeds it and applies what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULES", "Stage", "Schedule"]

SCHEDULES = ("fixed", "staged")


@dataclass(frozen=True)
class Stage:
    """What the groups do until the next boundary: ``synchronous`` (one group of every rank) or
    ``period_s`` seconds between exchanges with staleness bound ``bound``."""

    name: str
    period_s: float
    bound: int
    synchronous: bool = False


class Schedule:
    """The stage for each epoch, from the kind (``fixed``/``staged``) and the configured period and bound."""

    def __init__(self, kind: str, period_s: float, bound: int, plateau: float = 0.5) -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"unknown group schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
        self.kind = kind
        self.fine = Stage("fine" if kind == "staged" else "fixed", period_s, bound)
        self.coarse = Stage("coarse", 4 * period_s, 2 * bound)
        self.plateau = plateau
        self._largest = 0.0
        self.profile = Stage("profile", period_s, bound, synchronous=True)
        self.stage = self.profile if kind == "staged" else self.fine

    def after_profile(self) -> Stage:
        """The profiling steps are over: the first asynchronous stage."""
        self.stage = self.coarse if self.kind == "staged" else self.fine
        return self.stage

    def at_epoch(self, global_change: float | None) -> Stage:
        """An epoch boundary; ``global_change`` is the norm of the global model's change over the last
        epoch (``None`` when unknown, e.g. the parameter service is away): the stage for the next one."""
        if self.stage is self.coarse and global_change is not None:
            self._largest = max(self._largest, global_change)
            if self._largest > 0 and global_change < self.plateau * self._largest:
                self.stage = self.fine
        return self.stage

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the stage reached and the largest change seen (the plateau's reference)."""
        return {"kind": self.kind, "stage": self.stage.name, "largest_change": self._largest}

    def restore(self, state: dict[str, Any]) -> Stage:
        """Back to where :meth:`state` was taken, so a resumed run neither profiles again nor returns to
        the coarse stage. A state from the other kind of schedule is refused (``ValueError``): its stages
        mean something else."""
        if state.get("kind") != self.kind:
            raise ValueError(f"a {state.get('kind')!r} schedule's state cannot resume a {self.kind!r} schedule")
        kept = (self.profile, self.coarse, self.fine) if self.kind == "staged" else (self.fine,)
        stages = {s.name: s for s in kept}
        if state.get("stage") not in stages:
            raise ValueError(f"stage {state.get('stage')!r}: a {self.kind!r} schedule has {', '.join(stages)}")
        self.stage = stages[state["stage"]]
        self._largest = float(state.get("largest_change", 0.0))
        return self.stage
