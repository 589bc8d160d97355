"""The isolation controller: a closed loop on the protected job's own pace, one per device.

Where a device's jobs differ in class, the highest class there is protected: it should keep `target`
(0.97) of its speed alone. Every open-loop rule (gaps a lower phase fits, the guard, yields) predicts from
measured phases; whatever the prediction misses (copies through the GPU, the link, the host's cores) comes
out of the protected job. This controller measures the outcome instead:

* **Reference.** The protected job's iteration time with no lower job computing on the device, measured
  in *solo* windows: at start, when the device's jobs change, and every `solo_every` windows; never slower
  than its pace before any lower job came, where that is known (`AlonePace`). Windows are
  aligned on the wall clock (`offset` turns the daemon's clock into it), so every node of a job measures
  in the same windows, as `--adapt`'s do.
* **Budget.** How much device time per second the lower classes together may hold. Raised by
  `increase` after each window in which the protected job kept `target` of its reference, cut after
  each window in which it did not, by `cut_gain` times the shortfall and at most to `decrease` of itself (AIMD,
  as TGS's rate control and TCP do; the proportional cut keeps an iteration's jitter from halving it).
* **Enforcement** is the policy's: a lower-class phase is granted only while the lower classes' device
  time over the last window, with that phase, stays within the budget (`allows`); in a solo window the
  budget is 0. After `starve_windows` windows without a lower phase one is granted anyway, so that a
  lower rank never waits past its grant timeout (it would then train unscheduled, beside everything).

An iteration time is measured from the times at which the job's furthest rank asked for its next
iteration, so a window of a few iterations gives the mean of whole iterations, not a count rounded to
one. Pure: time and iterations come in as arguments; each budget change is returned as a `Change`, for
the event log.
"""
from __future__ import annotations

import enum
import math
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
    its multiplicative cut and its most (device seconds per second); `starve_windows`: after this many
    windows without any lower phase, one starts whatever the budget (a floor of about a phase per 8 s);
    `cut_gain`: a window short of the target by a share x of it cuts the budget by `cut_gain` x, at most to
    `decrease` of itself, so that a window a percent short (an iteration's jitter) trims the budget and one
    far short halves it (in the simulator's fleet, a plain halving left the low jobs 0.13x, a gain of 4 left
    the production job under its target, 8 met it with the low jobs at 0.20x)."""

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

    def __post_init__(self) -> None:
        if not 0.0 <= self.target <= 1.0:
            raise ValueError(f"target {self.target}: must be within 0..1 (0: off)")
        if not self.window_s > 0 or not 0.0 <= self.settle_share < 1.0:
            raise ValueError(f"window {self.window_s}s with settle share {self.settle_share}: need a window > 0 "
                             "and 0 <= settle share < 1")
        if self.solo_every < 1 or self.starve_windows < 1:
            raise ValueError("solo_every and starve_windows must be >= 1")
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


@dataclass
class _Pace:
    """One job's iteration boundaries seen in the window being measured: the first and the latest."""

    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None

    def seen(self, now: float, iteration: int) -> None:
        if self.last is None or iteration > self.last[1]:
            if self.first is None:
                self.first = (now, iteration)
            self.last = (now, iteration)

    def iteration_s(self) -> float | None:
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return None
        return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])


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
        """Each job's mean iteration time over its latest boundaries, where the latest is fresh."""
        out = {}
        for job, seen in self._seen.items():
            (t0, i0), (t1, i1) = seen[0], seen[-1]
            if i1 - i0 >= 3 and now - t1 <= self._fresh_s:
                out[job] = (t1 - t0) / (i1 - i0)
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
    current_s: dict[str, float] = field(default_factory=dict)  # job -> its iteration time in the last window
    window: Window = Window.SOLO
    _index: int | None = None  # the window being measured
    _shared_since_solo: int = 0
    _jobs: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # protected, lower
    _paces: dict[str, _Pace] = field(default_factory=dict)
    _furthest: dict[str, int] = field(default_factory=dict)  # job -> the furthest iteration asked for

    def __post_init__(self) -> None:
        if self.budget < 0:
            self.budget = self.settings.initial

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
        lower classes held nothing for `starve_windows` windows (one phase then, so that a rank never waits
        past its grant timeout and goes on unscheduled, which would cost the protected job more)."""
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
        the next one's kind. Returns a change of budget or reference, or None."""
        index = math.floor((now + self.offset) / self.settings.window_s)
        jobs = (protected, lower)
        if jobs != self._jobs:
            self._jobs = jobs
            self._furthest = {j: i for j, i in self._furthest.items() if j in protected}
            self.reference_s = {j: t for j, t in self.reference_s.items() if j in protected}
            return self._begin(index, Window.SOLO, "the device's jobs changed: measuring the protected job alone")
        if self._index is None:
            return self._begin(index, Window.SOLO, "measuring the protected job alone")
        if index == self._index:
            return None
        return self._judge(index)

    def _begin(self, index: int, window: Window, reason: str = "") -> Change | None:
        self._index, self.window, self._paces = index, window, {}
        if window is Window.SOLO:
            self._shared_since_solo = 0
        if not reason:
            return None
        return self._change(reason)

    def _judge(self, index: int) -> Change | None:
        paces = {j: t for j, p in self._paces.items() if j in self._jobs[0] and (t := p.iteration_s()) is not None}
        s = self.settings
        if self.window is Window.SOLO:
            if not paces:  # the protected job paused: share this window, and measure alone again the next
                self._begin(index, Window.SHARED)
                self._shared_since_solo = s.solo_every - 1
                return self._change("the protected job did not run alone: sharing, and measuring again next")
            self.reference_s.update({j: min(t, self.alone_s.get(j, t)) for j, t in paces.items()})
            self._begin(index, Window.SHARED)
            return self._change("the protected job measured alone")
        self._shared_since_solo += 1
        change = None
        common = [j for j in paces if j in self.reference_s]
        if common:
            self.current_s = paces
            kept = min(self.reference_s[j] / paces[j] for j in common)
            within = kept >= s.target
            cut = max(s.decrease, 1.0 - s.cut_gain * (s.target - kept) / s.target)
            budget = min(s.ceiling, self.budget + s.increase) if within else self.budget * cut
            why = (f"the protected job keeps {kept:.2f}x of its speed alone (target {s.target:g}): "
                   f"{'more' if within else 'less'} for the lower classes")
            if budget != self.budget:
                self.budget = budget
                change = why
        solo = self._shared_since_solo >= s.solo_every
        self._begin(index, Window.SOLO if solo else Window.SHARED)
        if solo:
            return self._change("measuring the protected job alone again")
        return None if change is None else self._change(change)

    def _change(self, reason: str) -> Change:
        protected = self._jobs[0]
        ref = [self.reference_s[j] for j in protected if j in self.reference_s]
        cur = [self.current_s[j] for j in protected if j in self.current_s]
        return Change(round(self.budget, 4), reason, self.window, max(ref, default=None), max(cur, default=None))

    def view(self, lower_held_s: dict[str, float]) -> IsolationView:
        """What `crossover queue` shows; `lower_held_s`: each lower job's device time over the last window."""
        c = self._change("")
        w = self.settings.window_s
        return IsolationView(self.window, self.settings.target, self.allowed(), c.reference_s, c.current_s,
                             {job: held / w for job, held in lower_held_s.items()})

    def kept(self) -> float | None:
        """The protected jobs' speed in the last shared window relative to alone (the least of them)."""
        common = [j for j in self.current_s if j in self.reference_s]
        return min((self.reference_s[j] / self.current_s[j] for j in common), default=None)
