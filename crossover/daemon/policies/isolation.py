"""The isolation controller: a closed loop on the protected job's own pace, one per device.

Where a device's jobs differ in class, the highest class there is protected: it should keep `target`
(0.97) of its speed alone. Every open-loop rule (gaps a lower phase fits, the guard, yields) predicts from
measured phases; whatever the prediction misses (copies through the GPU, the link, the host's cores) comes
out of the protected job. This controller measures the outcome instead:

* **Reference.** The protected job's iteration time with no lower job computing on the device, measured
  in *solo* windows: at start and when the device's jobs change (over up to `max_solo` windows, for a job
  whose iteration outlasts one), and every `solo_every` + 1-th window of the wall clock (`offset` turns the
  daemon's clock into it), so that every node of a job measures it alone in the same windows; pooled over
  its latest `reference_windows` solo measurements; never slower than its pace before any lower job came,
  where that is known and recent (`AlonePace`).
* **Budget.** How much device time per second the lower classes together may hold. Raised by
  `increase` after each window in which the protected job kept `target` of its reference (its shared
  windows since the last cut pooled, up to `smooth_windows`), cut when it did not, by `cut_gain` times the
  shortfall and at most to `decrease` of itself (AIMD, as TGS's rate control and TCP do; and as TCP,
  doubled instead of raised until the first cut after the device's jobs change). A judgement knows
  how sure it is: the spread of the iterations it pooled, and of the reference's, give a standard error.
  A reading short by more than `confidence` standard errors cuts at once, and one above the target by
  more than that raises at once; one within its noise of the target (or of too few iterations to know it)
  holds the budget and pools the next window, and cuts or raises once the pool is full. A few iterations'
  jitter then neither halves the budget nor trims it window after window, and a budget is not raised on
  a reading that only jitter put above the target (raised on every such reading, the budget saw-toothed
  around the target and the protected job's pace averaged a percent or more below it). Slow start is the
  exception: until its first cut a window within the target doubles the budget, sure or not, so that a low
  job gets its share within seconds of coming (a raise that waited for a sure margin doubled once per full
  pool, and on a noisy node the budget was still climbing when a short-lived low job left). Each cut and each
  raise is judged on the windows after it.
* **Enforcement** is the policy's: a lower-class phase is granted only while the lower classes' device
  time over the last window, with that phase, stays within the budget (`allows`); in a solo window the
  budget is 0. A lower rank that has waited `starve_windows` windows gets its phase anyway in a shared
  window, so that it never waits past its grant timeout (it would then train unscheduled, beside
  everything).

An iteration time is measured from the times at which the job's furthest rank asked for its next
iteration, so a window of a few iterations gives the mean of whole iterations, not a count rounded to
one. Pure: time and iterations come in as arguments; each budget change is returned as a `Change`, for
the event log.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AlonePace", "Change", "IsolationController", "IsolationSettings", "IsolationView", "Window"]


class Window(enum.Enum):
    SOLO = "solo"
    SHARED = "shared"


@dataclass(frozen=True)
class IsolationSettings:
    """`target`: the share of its speed alone the protected job keeps (`crossoverd --protect`; 0 turns the
    controller off); `window_s`: one window, aligned on the wall clock; `settle_share`: its start, left out
    of the measure while the previous window's work drains; `solo_every`: a solo window after this many
    shared ones; `initial`, `increase`, `decrease`, `ceiling`: the budget's start, its additive step up,
    its multiplicative cut and its most (device seconds per second); `starve_windows`: a lower rank that
    has waited this many windows gets its whole phase whatever the budget, the gaps and its guard credit, and
    is not asked to yield it (the floor: about a phase per rank per 8 s);
    `cut_gain`: a window short of the target by a share x of it cuts the budget by `cut_gain` x, at most to
    `decrease` of itself, so that a window a percent short (an iteration's jitter) trims the budget and one
    far short halves it (in the simulator's fleet, a plain halving left the low jobs 0.13x, a gain of 4 left
    the production job under its target, 8 met it with the low jobs at 0.20x); `max_solo`: consecutive solo
    windows a job without a reference is measured over (a job whose iteration outlasts a window needs
    several); `alone_keep_s`: how long the job's pace before any lower job came caps its reference;
    `smooth_windows`: the most shared windows a judgement pools (the iterations of the last this many since
    the last cut); `confidence`: a pooled pace short of the target cuts at once (above it, raises at once) only where it
    is off by more than this many standard errors (its iterations' spread, and the reference's), and
    otherwise once `smooth_windows` windows are pooled and it still reads so, so that a few iterations'
    jitter does not read as a shortfall or a margin and a true one is still acted on within
    `smooth_windows` windows; `reference_windows`:
    the solo windows the reference pools, each the latest of its run (one window of a few iterations read
    the model bed's job 0.87-1.07x of another); `slow_start`: until the first cut after the device's jobs
    change, a window within the target, sure of it or not, doubles the budget instead of adding `increase`
    (TCP's slow start: from 0.1 the budget reaches 0.8 in three windows, not fourteen; low jobs that stay
    half a minute spent it climbing)."""

    target: float = 0.97
    window_s: float = 2.0
    settle_share: float = 0.25
    solo_every: int = 15
    initial: float = 0.1
    increase: float = 0.05
    decrease: float = 0.5
    ceiling: float = 1.0
    starve_windows: int = 4
    cut_gain: float = 8.0
    max_solo: int = 3
    alone_keep_s: float = 600.0
    smooth_windows: int = 4
    confidence: float = 1.0
    reference_windows: int = 3
    slow_start: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.target <= 1.0:
            raise ValueError(f"target {self.target}: must be within 0..1 (0: off)")
        if not self.window_s > 0 or not 0.0 <= self.settle_share < 1.0:
            raise ValueError(f"window {self.window_s}s with settle share {self.settle_share}: need a window > 0 "
                             "and 0 <= settle share < 1")
        if min(self.solo_every, self.starve_windows, self.max_solo, self.smooth_windows, self.reference_windows) < 1:
            raise ValueError("solo_every, starve_windows, max_solo, smooth_windows and reference_windows must be >= 1")
        if self.confidence < 0:
            raise ValueError(f"confidence {self.confidence}: must be >= 0 (standard errors)")
        if not 0.0 < self.decrease < 1.0 or self.increase <= 0 or not 0.0 <= self.initial <= self.ceiling <= 1.0:
            raise ValueError("need 0 < decrease < 1, increase > 0 and 0 <= initial <= ceiling <= 1")
        if self.cut_gain <= 0:
            raise ValueError(f"cut_gain {self.cut_gain}: must be > 0")

    @property
    def on(self) -> bool:
        return self.target > 0


@dataclass(frozen=True)
class Change:
    """A change of the budget, or of the reference, and why (an `isolation` event)."""

    budget: float
    reason: str
    window: Window
    reference_s: float | None
    current_s: float | None


@dataclass(frozen=True)
class IsolationView:
    """A device's controller as `crossover queue` shows it: the window, the budget, the protected job's
    iteration time alone and now, and the device time per second each lower job (by name) held last window."""

    window: Window
    target: float
    budget: float
    reference_s: float | None
    current_s: float | None
    lower_share: dict[str, float]
    kept: float | None = None  # the protected jobs' speed last judged (the windows pooled) against alone, the least


@dataclass(frozen=True)
class _Evidence:
    """Iterations measured and what they took: `seconds` in all, `squares` the sum of each step's squared
    time per iteration weighted by its iterations, `steps` the boundaries' gaps they came in."""

    iterations: int = 0
    seconds: float = 0.0
    squares: float = 0.0
    steps: int = 0

    def __add__(self, other: _Evidence) -> _Evidence:
        return _Evidence(self.iterations + other.iterations, self.seconds + other.seconds,
                         self.squares + other.squares, self.steps + other.steps)

    @property
    def iteration_s(self) -> float:
        return self.seconds / self.iterations

    def relative_error(self) -> float | None:
        """The standard error of `iteration_s` over itself, from the steps' spread (None: under 3 steps, not
        known; a judgement then waits for a full pool).
        Steps are taken as independent, which overstates the error where one slow iteration is followed by
        a fast one (the usual case): a cut it holds back comes at the latest when the pool is full."""
        mean = self.iteration_s
        if self.steps < 3 or mean <= 0:
            return None
        variance = max(0.0, self.squares / self.iterations - mean * mean)
        return math.sqrt(variance / self.iterations) / mean


def _pool(evidence: deque[_Evidence]) -> _Evidence:
    return sum(evidence, _Evidence())


@dataclass
class _Pace:
    """One job's iteration boundaries seen in the window being measured: the first, the latest, and the
    spread of the steps between them."""

    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    _squares: float = 0.0
    _steps: int = 0

    def seen(self, now: float, iteration: int) -> None:
        if self.last is None or iteration > self.last[1]:
            if self.first is None:
                self.first = (now, iteration)
            elif self.last is not None:
                seconds, iterations = now - self.last[0], iteration - self.last[1]
                self._squares += seconds * seconds / iterations
                self._steps += 1
            self.last = (now, iteration)

    def evidence(self) -> _Evidence | None:
        """What the window measured (None: under one whole iteration)."""
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return None
        return _Evidence(self.last[1] - self.first[1], self.last[0] - self.first[0], self._squares, self._steps)


class AlonePace:
    """Each job's latest iteration boundaries while no lower class shares its device: its pace truly alone.

    A solo window is not quite alone: the lower jobs' processes stay, and their frameworks' own threads
    (Horovod's background loop coordinates a job's ranks every cycle) take host time from the protected job.
    So a controller starts from the pace the job had before any lower job came, where that is fresh, and
    keeps the faster of it and its solo windows' (`IsolationController.alone_s`)."""

    def __init__(self, keep: int = 20, fresh_s: float = 60.0) -> None:
        self._keep, self._fresh_s = keep, fresh_s
        self._seen: dict[str, list[tuple[float, int]]] = {}

    def request(self, job: str, iteration: int, now: float) -> None:
        seen = self._seen.setdefault(job, [])
        if not seen or iteration > seen[-1][1]:
            seen.append((now, iteration))
            del seen[:-self._keep]

    def iteration_s(self, now: float) -> dict[str, float]:
        """Each job's median iteration time over its latest boundaries, where the latest is fresh (a median,
        so that a slow first iteration or a pause does not set it)."""
        out = {}
        for job, seen in self._seen.items():
            steps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(seen, seen[1:])]
            if len(steps) >= 3 and now - seen[-1][0] <= self._fresh_s:
                out[job] = statistics.median(steps)
        return out

    def forget(self, jobs: set[str]) -> None:
        for job in list(self._seen):
            if job not in jobs:
                del self._seen[job]


@dataclass
class IsolationController:
    """One device's budget for its lower classes, from its protected jobs' pace (see the module)."""

    settings: IsolationSettings = field(default_factory=IsolationSettings)
    offset: float = 0.0  # wall clock minus the clock `now` comes from
    budget: float = -1.0  # device seconds per second the lower classes may hold (-1: not set yet)
    reference_s: dict[str, float] = field(default_factory=dict)  # job -> its iteration time alone
    alone_s: dict[str, float] = field(default_factory=dict)  # job -> its pace before any lower job came (`AlonePace`)
    current_s: dict[str, float] = field(default_factory=dict)  # job -> its iteration time last judged (pooled)
    window: Window = Window.SOLO
    _index: int | None = None  # the window being measured
    _unmeasured: int = 0  # consecutive solo windows that measured no job still without a reference
    _alone_until: float | None = None  # when `alone_s` stops capping the reference
    _jobs: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # protected, lower
    _paces: dict[str, _Pace] = field(default_factory=dict)
    _furthest: dict[str, int] = field(default_factory=dict)  # job -> the furthest iteration asked for
    _pooled: dict[str, deque[_Evidence]] = field(default_factory=dict)  # job -> its shared windows since the last cut
    _solos: dict[str, deque[_Evidence]] = field(default_factory=dict)  # job -> its latest solo measurements
    _starting: bool = True  # slow start: no cut yet since the device's jobs last changed
    _solo_run: set[str] = field(default_factory=set)  # jobs whose measurement in this solo run is in `_solos`

    def __post_init__(self) -> None:
        if self.budget < 0:
            self.budget = self.settings.initial
        self._starting = self.settings.slow_start

    @property
    def protected(self) -> frozenset[str]:
        return self._jobs[0]

    @property
    def lower(self) -> frozenset[str]:
        return self._jobs[1]

    def allowed(self) -> float:
        """The lower classes' budget now: 0 in a solo window."""
        return 0.0 if self.window is Window.SOLO else self.budget

    def allows(self, held_s: float, phase_s: float, starving: bool) -> bool:
        """Whether a lower-class phase of about `phase_s` may start, the lower classes having held the device
        `held_s` over the last window. Never in a solo window; otherwise within the budget, or `starving`: the
        rank has waited `starve_windows` windows (its phase then, so that it never waits past its grant
        timeout and goes on unscheduled, which would cost the protected job more)."""
        if self.window is Window.SOLO:
            return False
        return starving or held_s + phase_s <= self.budget * self.settings.window_s

    def next_boundary(self, now: float) -> float:
        """When the window `now` falls in ends (on the caller's clock)."""
        w = self.settings.window_s
        return (math.floor((now + self.offset) / w) + 1) * w - self.offset

    def request(self, job: str, iteration: int, now: float) -> None:
        """A rank of `job` asked for the device for `iteration`: the job's pace, as its furthest rank sets it."""
        if iteration <= self._furthest.get(job, -1):
            return
        self._furthest[job] = iteration
        if self._index is not None and self._measuring(now):
            self._paces.setdefault(job, _Pace()).seen(now, iteration)

    def _measuring(self, now: float) -> bool:
        w = self.settings.window_s
        return (now + self.offset) - self._index * w >= self.settings.settle_share * w  # type: ignore[operator]

    def step(self, protected: frozenset[str], lower: frozenset[str], now: float) -> Change | None:
        """Advance to the window `now` falls in, given the device's jobs: judge the window that ended and pick
        the next one's kind. Returns a change of budget or reference, or None.

        Solo windows come at fixed places on the wall clock (every `solo_every` + 1-th window), so every node
        of a job measures it alone in the same windows; a job without a reference (at start, when the jobs
        change) is measured alone at once, over up to `max_solo` windows."""
        index = math.floor((now + self.offset) / self.settings.window_s)
        if self._alone_until is None:
            self._alone_until = now + self.settings.alone_keep_s
        jobs = (protected, lower)
        if jobs != self._jobs:
            self._jobs = jobs
            self._furthest = {j: i for j, i in self._furthest.items() if j in protected}
            self.reference_s = {j: t for j, t in self.reference_s.items() if j in protected}
            self._pooled.clear()
            self._solos.clear()
            self._starting = self.settings.slow_start
            self._unmeasured = 0
            return self._begin(index, Window.SOLO, "the device's jobs changed: measuring the protected job alone")
        if index == self._index:
            return None
        return self._judge(index, now)

    def _solo_slot(self, index: int) -> bool:
        return index % (self.settings.solo_every + 1) == 0

    def _unreferenced(self) -> bool:
        return any(j not in self.reference_s for j in self._jobs[0])

    def _begin(self, index: int, window: Window, reason: str = "") -> Change | None:
        if not (window is Window.SOLO and self.window is Window.SOLO and self._index is not None
                and index == self._index + 1 and not reason):
            self._paces = {}  # a solo window that goes on keeps measuring: a slow job needs several
            self._solo_run = set()
        self._index, self.window = index, window
        if not reason:
            return None
        return self._change(reason)

    def _judge(self, index: int, now: float) -> Change | None:
        measured = {j: e for j, p in self._paces.items() if j in self._jobs[0] and (e := p.evidence()) is not None}
        s = self.settings
        if self.window is Window.SOLO:
            cap = self.alone_s if self._alone_until is not None and now <= self._alone_until else {}
            for j, e in measured.items():
                solos = self._solos.setdefault(j, deque(maxlen=s.reference_windows))
                if j in self._solo_run:
                    solos[-1] = e  # the same run, measured further: one measurement, not two
                else:
                    solos.append(e)
                    self._solo_run.add(j)
                t = _pool(solos).iteration_s
                self.reference_s[j] = min(t, cap.get(j, t))
            self._unmeasured = 0 if measured else self._unmeasured + 1
            if self._unreferenced() and self._unmeasured < s.max_solo and index == self._index + 1:  # type: ignore[operator]
                self._begin(index, Window.SOLO)
                return None
            kind = Window.SOLO if self._solo_slot(index) else Window.SHARED
            self._begin(index, kind)
            if measured:
                return self._change("the protected job measured alone")
            return self._change("the protected job did not run alone: sharing until the next solo window")
        change = None
        common = [j for j, e in measured.items() if j in self.reference_s and e.seconds > 0]
        if common:
            self.current_s = {j: e.iteration_s for j, e in measured.items()}
            change = self._budget(common, measured)
        if self._solo_slot(index):
            self._unmeasured = 0
            self._begin(index, Window.SOLO)
            return self._change("measuring the protected job alone again")
        self._begin(index, Window.SHARED)
        return None if change is None else self._change(change)

    def _budget(self, common: list[str], measured: dict[str, _Evidence]) -> str | None:
        """Judge a shared window: raise the budget if every protected job kept the target over the windows
        pooled, cut it if the slowest one is surely short of it (or still short with the pool full), else
        hold it. Returns why the budget changed, or None."""
        s = self.settings
        readings = []
        for j in common:
            pool = self._pooled.setdefault(j, deque(maxlen=s.smooth_windows))
            pool.append(measured[j])
            now = _pool(pool)
            self.current_s[j] = now.iteration_s  # what was judged, as the queue, the gauge and the event show
            solos = self._solos.get(j)
            now_error, reference_error = now.relative_error(), _pool(solos).relative_error() if solos else 0.0
            error = None if now_error is None or reference_error is None else math.hypot(now_error, reference_error)
            readings.append((self.reference_s[j] / now.iteration_s, error, len(pool)))
        kept, error, pooled = min(readings, key=lambda r: r[0])
        full = pooled >= s.smooth_windows
        sure_above = error is not None and kept * (1.0 - s.confidence * error) >= s.target
        sure_below = error is not None and kept * (1.0 + s.confidence * error) < s.target
        if kept >= s.target and (self._starting or full or sure_above):
            step = max(s.increase, self.budget) if self._starting else s.increase
            budget, verdict = min(s.ceiling, self.budget + step), "more"
        elif kept < s.target and (full or sure_below):
            budget, verdict = self.budget * max(s.decrease, 1.0 - s.cut_gain * (s.target - kept) / s.target), "less"
            self._starting = False
        else:
            return None  # within its noise of the target: pool another window before cutting or raising
        self._pooled.clear()  # each raise and each cut is judged on the windows after it
        if budget == self.budget:
            return None
        self.budget = budget
        return (f"the protected job keeps {kept:.2f}x of its speed alone (target {s.target:g}): "
                f"{verdict} for the lower classes")

    def _shown(self) -> tuple[float | None, float | None]:
        """The protected jobs' iteration time alone and as last judged (the longest of each)."""
        protected = self._jobs[0]
        ref = [self.reference_s[j] for j in protected if j in self.reference_s]
        cur = [self.current_s[j] for j in protected if j in self.current_s]
        return max(ref, default=None), max(cur, default=None)

    def _change(self, reason: str) -> Change:
        return Change(round(self.budget, 4), reason, self.window, *self._shown())

    def view(self, lower_held_s: dict[str, float]) -> IsolationView:
        """What `crossover queue` shows; `lower_held_s`: each lower job's device time over the last window."""
        w = self.settings.window_s
        return IsolationView(self.window, self.settings.target, self.allowed(), *self._shown(),
                             {job: held / w for job, held in lower_held_s.items()}, self.kept())

    def kept(self) -> float | None:
        """The protected jobs' speed as last judged (the shared windows pooled) relative to alone, the least."""
        common = [j for j in self.current_s if j in self.reference_s]
        return min((self.reference_s[j] / self.current_s[j] for j in common), default=None)
