"""How often groups exchange and how far apart they may drift: fixed, or staged (ASHL).

``fixed``: every exchange uses the configured period and bound. ``staged`` has ASHL's three stages:

1. ``profile``: the configured period and bound while the service learns what an exchange costs. Nobody
   waits: every rank trains (ASHL's profiling is synchronous and waits for the straggler), each rank's pace
   is measured as it goes, and its group's batch is cut by it from the group's second epoch on
   (`member_shares`).
2. ``coarse`` (4x the period, 2x the bound: infrequent exchanges, a loose bound, to get close fast), only
   where it pays. It saves three exchanges in four and costs freshness, so it pays only where exchanges are
   dear. The service feeds :meth:`Schedule.priced` what each exchange cost its leader (the wait for the
   staleness bound left out); once it has heard ``PRICED_AFTER`` of them, a median of at least ``pays`` times
   the period (a tenth by default: under that the coarse stage would save under 7.5 % of a leader's time)
   starts the coarse stage, and a cheaper one goes straight to the fine stage. Pricing first matters: a
   coarse stage entered before its price is known trains the job's first seconds, when the model moves
   fastest, on stale exchanges for nothing where they are cheap.
3. ``fine`` (the configured period and bound) to converge carefully.

The end of the coarse stage is driven by measured progress, read where the whole job's progress is visible:
the parameter service, which feeds :meth:`Schedule.observe` the global model's change over each window of
wall time. Once the rate of change falls below ``plateau`` times the fastest rate seen, the coarse stage has
done what it is for and the fine stage begins. The service then holds every group to the stage's bound and
tells each leader the stage (and so its period) with its next answer: no boundary, no barrier.
Measured on the 2-core VM: an exchange on loopback costs 2-10 ms against a fine period of 0.5 s, and
0.36-0.54 s across a 1 Gbit/s link.
Pure logic: the service feeds it and applies what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

__all__ = ["PRICED_AFTER", "SCHEDULES", "Stage", "Schedule"]

SCHEDULES = ("fixed", "staged")
PRICED_AFTER = 8  # exchanges whose cost the profile stage hears before it judges whether a coarse stage pays


@dataclass(frozen=True)
class Stage:
    """What the groups do until the next switch: ``period_s`` seconds between exchanges, with staleness bound
    ``bound``."""

    name: str
    period_s: float
    bound: int


class Schedule:
    """The stage, from the kind (``fixed``/``staged``), the configured period and bound, and what the service
    measures: ``pays``, the share of the period an exchange must cost for the coarse stage to be entered;
    ``plateau``, the share of the fastest rate of change below which it ends; ``window_s``, the wall time each
    observation of progress spans (4 coarse periods unless given)."""

    def __init__(self, kind: str, period_s: float, bound: int, plateau: float = 0.5,
                 window_s: float | None = None, pays: float = 0.1) -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"unknown group schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
        self.kind = kind
        self.fine = Stage("fine" if kind == "staged" else "fixed", period_s, bound)
        self.profile = Stage("profile", period_s, bound)
        self.coarse = Stage("coarse", 4 * period_s, 2 * bound)
        self.plateau = plateau
        self.window_s = window_s if window_s is not None else 4 * self.coarse.period_s
        self.peak_rate = 0.0
        self.pays = pays
        self.costs: list[float] = []  # the profile stage's exchanges' costs, seconds
        self.stage = self.profile if kind == "staged" else self.fine

    def named(self, name: str) -> Stage:
        """This schedule's stage called ``name`` (what a service's answer names)."""
        staged = (self.profile, self.coarse, self.fine)
        stages = {s.name: s for s in staged} if self.kind == "staged" else {self.fine.name: self.fine}
        if name not in stages:
            raise ValueError(f"stage {name!r}: a {self.kind!r} schedule has {', '.join(stages)}")
        return stages[name]

    def observe(self, change: float, elapsed_s: float) -> Stage:
        """The global model moved by ``change`` (its L2 norm) over the last ``elapsed_s`` seconds: the stage
        from now on. Only the coarse stage ends, and only once its rate of change has flattened."""
        if self.stage is self.coarse and elapsed_s > 0:
            rate = change / elapsed_s
            self.peak_rate = max(self.peak_rate, rate)
            if self.peak_rate > 0 and rate < self.plateau * self.peak_rate:
                self.stage = self.fine
        return self.stage

    def priced(self, cost_s: float) -> Stage:
        """An exchange cost its leader ``cost_s`` seconds: the stage from now on. The profile stage ends once
        ``PRICED_AFTER`` costs are in: in the coarse stage if their median is at least ``pays`` times the
        period, else in the fine one."""
        if self.stage is self.profile:
            self.costs.append(cost_s)
            if len(self.costs) == PRICED_AFTER:
                dear = median(self.costs) >= self.pays * self.fine.period_s
                self.stage = self.coarse if dear else self.fine
        return self.stage

    @property
    def exchange_s(self) -> float | None:
        """The median of the costs :meth:`priced` heard (``None`` before any)."""
        return median(self.costs) if self.costs else None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the stage reached and the fastest rate of change seen (the plateau's reference)."""
        return {"kind": self.kind, "stage": self.stage.name, "peak_rate": self.peak_rate}

    def restore(self, state: dict[str, Any]) -> Stage:
        """Back to where :meth:`state` was taken, so a resumed run does not return to an earlier stage. A state
        from the other kind of schedule is refused (``ValueError``): its stages mean something else. A run
        resumed in the profile stage prices its exchanges again."""
        if state.get("kind") != self.kind:
            raise ValueError(f"a {state.get('kind')!r} schedule's state cannot resume a {self.kind!r} schedule")
        self.stage = self.named(str(state.get("stage")))
        self.peak_rate = float(state.get("peak_rate", 0.0))
        return self.stage
