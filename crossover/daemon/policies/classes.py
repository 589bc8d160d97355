"""Priority classes: which waiting job goes first when jobs on a device do not matter alike.

Every job has a `JobClass`: a priority (`high`, `normal`, `low`) and, within
it, a weight. The rules, applied by the `crossover` policy on each device only
while its jobs differ in class or weight (equal classes: today's order, exactly):

* **Higher first.** A waiting rank of a higher class goes before any of a lower one.
* **Into gaps only.** A lower-class compute phase is granted only if it is
  expected to end before every higher-class job on the device is back (give or
  take `fit_margin`): the higher job left the device when its allreduce began,
  and the gap is the lower quartile of its latest allreduces; the lower phase,
  the upper quartile of its latest phases. Without a measure yet, or once a higher job is
  overdue by more than its own allreduce (it paused: evaluation, a checkpoint),
  the gap counts as open. A phase that does not fit is cut to the gap (a *cut turn*):
  granted, and its rank asked to yield when the gap is due to close, early by
  how long the job's latest yields took to come back; for a job whose asks mostly
  end in its phase's end rather than a yield (work without gradients in between),
  or where the gap left is not worth a hand-over, it is held back instead until the
  gap closes or the guard below serves it.
* **Yield on demand.** When a higher-class rank asks for a device that a
  lower-class job holds, the holders are asked to yield (`take_preemptions`);
  the plugin hands the device back at its next gradient hook, so the higher job
  waits about one layer's backward, not a whole phase.
* **Weights within a class.** Among waiting jobs of one class whose weights
  differ, the one with the least recent device time per weight goes first.
* **A closed loop on the highest class's pace.** Every rule above is open-loop: it predicts from
  measured phases. The isolation controller (`policies.isolation`) measures what the highest class's
  jobs keep of their speed alone and sets how much device time per second the lower classes may hold;
  a lower phase starts only within that budget, whatever the rules above allow.
* **Starvation guard.** Each lower-class job earns `guard_share` seconds of
  device time per second (capped at `guard_window_s` of it) and spends what it
  holds. A waiting job whose credit covers its next phase is served before any
  higher class, within the isolation budget, and is not asked to yield it: every job keeps
  progressing at its guaranteed share. Under the controller a lower rank that has waited its
  `starve_windows` since it first asked for its iteration (its yields do not restart the wait)
  gets its phase whatever the budget, the gaps and its credit (the floor).

Pure: time comes only through `now`; the policy feeds it what it observes.
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from crossover.daemon.policies.isolation import IsolationSettings

__all__ = ["ClassBook", "ClassSettings", "JobClass", "Priority"]

_RECENT = 8  # phases a job's gap and phase estimates look back on


def _quantile(xs: deque[float] | None, q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Priority(enum.IntEnum):
    """A job's class; a larger value goes first."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, text: str) -> Priority:
        """`high`, `normal` or `low` (any case); ValueError names the choices."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"priority {text!r}: choose one of high, normal, low") from None

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class JobClass:
    """A job's class and its weight within the class (a share of the device relative to its peers)."""

    priority: Priority = Priority.NORMAL
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.01 <= self.weight <= 100.0 or self.weight != self.weight:
            raise ValueError(f"weight {self.weight}: must be within 0.01..100")

    def __str__(self) -> str:
        return f"{self.priority}" + ("" if self.weight == 1.0 else f" x{self.weight:g}")


@dataclass(frozen=True)
class ClassSettings:
    """`guard_share`: the device time every lower-class job is guaranteed (0.02: a fiftieth; at 0.05 the
    simulator's production job beside a low job on a device without gaps kept 0.93x, under the isolation
    controller's 0.97 target; at 0.02 it keeps 0.97x, and without a guard the low job there stops,
    `docs/benchmarks.md`);
    `guard_window_s`: how much unspent guarantee a job may save up, in seconds of wall time;
    `fit_margin`: a lower phase fits a gap up to this many times the gap's length (1.2: its slower
    quartile may overrun the gap's shorter quartile by a fifth, which the higher job then waits; with
    yields at gradients it waits less; `math.inf`: any gap, the rule off, as `bench.priority --rules` measures it);
    `cut_turns`: a lower phase that does not fit a gap is granted it and asked to yield as it closes, where
    its job yields when asked (False: held back instead until the gap closes, as before 2026-11-29);
    `window_s`: how far back recent device time counts, for weights;
    `isolation`: the closed loop that holds the highest class at its target pace (`policies.isolation`)."""

    guard_share: float = 0.02
    guard_window_s: float = 10.0
    fit_margin: float = 1.2
    cut_turns: bool = True
    window_s: float = 10.0
    isolation: IsolationSettings = field(default_factory=IsolationSettings)

    def __post_init__(self) -> None:
        if not 0.0 <= self.guard_share < 1.0:
            raise ValueError(f"guard_share {self.guard_share}: must be within [0, 1)")
        if self.guard_window_s <= 0 or self.window_s <= 0:
            raise ValueError("guard_window_s and window_s must be > 0")
        if not (0.5 <= self.fit_margin <= 2.0 or self.fit_margin == math.inf):
            raise ValueError(f"fit_margin {self.fit_margin}: must be within 0.5..2 (or inf: any gap)")


class ClassBook:
    """What the class rules need to remember per job: class, credit, recent device time, allreduce timing."""

    def __init__(self, settings: ClassSettings | None = None) -> None:
        self.settings = settings or ClassSettings()
        self.classes: dict[str, JobClass] = {}
        self._credit: dict[str, tuple[float, float]] = {}  # job -> (credit s, as of when)
        self._served: deque[tuple[float, str, float, int]] = deque()  # (released at, job, held s, device)
        self.left_at: dict[str, float] = {}  # job -> when its last compute phase here ended
        self.comm: dict[str, float] = {}  # job -> EMA of its allreduce
        self._comms: dict[str, deque[float]] = {}  # job -> its latest allreduces
        self._computes: dict[str, deque[float]] = {}  # job -> its latest compute phases
        self._answers: dict[str, deque[float]] = {}  # job -> how long its latest yields came after the ask
        self._yielding: dict[str, deque[bool]] = {}  # job -> whether its latest answered asks ended in a yield

    def of(self, job: str) -> JobClass:
        return self.classes.get(job, JobClass())

    def forget(self, job: str) -> None:
        for d in (self.classes, self._credit, self.left_at, self.comm, self._comms, self._computes, self._answers,
                  self._yielding):
            d.pop(job, None)  # type: ignore[attr-defined]

    @property
    def credit_cap(self) -> float:
        """The most guaranteed device time a job can save up (`guard_share` over `guard_window_s`)."""
        return self.settings.guard_share * self.settings.guard_window_s

    def credit(self, job: str, now: float) -> float:
        """Seconds of guaranteed device time the job has saved up by `now` (below 0 after a phase longer than
        what it had: it pays the rest back before the next)."""
        value, since = self._credit.get(job, (0.0, now))
        return min(self.credit_cap, value + self.settings.guard_share * max(0.0, now - since))

    def served(self, job: str, held_s: float, now: float, device: int = -1) -> None:
        """The job held `device` for `held_s` until `now` (its allreduce begins)."""
        self._credit[job] = (self.credit(job, now) - held_s, now)
        self._served.append((now, job, held_s, device))
        self.left_at[job] = now
        while self._served and self._served[0][0] < now - self.settings.window_s:
            self._served.popleft()

    def held_since(self, jobs: set[str] | frozenset[str], since: float, device: int) -> float:
        """Device time the jobs' phases on `device` released since `since` held (at most `window_s` back)."""
        return sum(h for t, j, h, d in self._served if j in jobs and t >= since and d == device)

    def recent(self, job: str) -> float:
        """Device time the job held in the last `window_s` (as of its latest release)."""
        return sum(h for _, j, h, _d in self._served if j == job)

    def observe_comm(self, job: str, duration_s: float, alpha: float) -> None:
        old = self.comm.get(job)
        self.comm[job] = duration_s if old is None else (1 - alpha) * old + alpha * duration_s
        self._comms.setdefault(job, deque(maxlen=_RECENT)).append(duration_s)

    def observe_compute(self, job: str, duration_s: float) -> None:
        self._computes.setdefault(job, deque(maxlen=_RECENT)).append(duration_s)

    def short_gap(self, job: str) -> float | None:
        """A gap the job's allreduce leaves at least about three times in four: the lower quartile of its
        latest allreduces. An allreduce slowed by another job's on the link must not widen the gap a lower
        phase is fitted into."""
        return _quantile(self._comms.get(job), 0.25)

    def answered(self, job: str, after_s: float, yielded: bool) -> None:
        """A rank of the job asked to yield handed its device back `after_s` later: in a yield (`yielded`), or
        at its phase's end (it had no gradient to yield at before it)."""
        self._yielding.setdefault(job, deque(maxlen=_RECENT)).append(yielded)
        if yielded:
            self._answers.setdefault(job, deque(maxlen=_RECENT)).append(after_s)

    def yield_lead(self, job: str) -> float:
        """How long before a gap closes the job's rank must be asked to yield for the device to be back in
        time about three times in four (upper quartile of its latest yields; 0 before any)."""
        return _quantile(self._answers.get(job), 0.75) or 0.0

    def yields_promptly(self, job: str) -> bool:
        """Whether asking the job to yield mostly ends in a yield: at least half of its latest answered asks
        (assumed before two are). A job judged not to is not given a cut turn again, so it stays judged:
        each would cost the higher job a phase's overrun, which the isolation controller answers with a cut."""
        answers = self._yielding.get(job, ())
        return len(answers) < 2 or 2 * sum(answers) >= len(answers)

    def long_phase(self, job: str) -> float | None:
        """How long the job's compute phase takes at most about three times in four (upper quartile)."""
        return _quantile(self._computes.get(job), 0.75)

    def opens_at(self, job: str) -> float | None:
        """When a job away from the device is overdue by its allreduce (it paused): from then on its gap
        counts as open. None: not known."""
        left, comm = self.left_at.get(job), self.comm.get(job)
        return None if left is None or comm is None else left + 2 * comm

    def back_at(self, job: str, now: float) -> float | None:
        """When a job away from the device (in its allreduce) is expected back; None: not known, or
        past `opens_at` (its gap counts as open)."""
        opens, gap = self.opens_at(job), self.short_gap(job)
        if opens is None or gap is None or now > opens:
            return None
        return self.left_at[job] + gap

    def uniform(self, jobs: set[str]) -> bool:
        """True when every job named has the same class and weight: the class rules change nothing."""
        return len({self.of(j) for j in jobs}) <= 1
