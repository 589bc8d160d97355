"""Whether a device's grants pay: probe scheduled against unscheduled, keep the faster, probe again.

Grants cost a hand-over per compute phase; they pay back only where two jobs'
compute phases would slow each other more than that (a GPU's context
switches, a working set that thrashes a cache). Which of the two wins depends
on the jobs, so a device measures it: its jobs train in alternate windows with
grants (`SCHEDULED`) and without (`UNSCHEDULED`, every rank leased), and the
mode under which the jobs made more progress is kept for a while, then probed
again. A change in the device's jobs starts a new probe at once.

Progress is each job's iteration rate (the compute phases the daemon saw its
furthest rank end: nothing a client claims), and a job's rate is the same on every
node it spans. Windows are aligned on the wall clock, so every node's daemon
probes in the same windows and, where its devices hold the same jobs, keeps
the same mode: no job's ranks run scheduled on one node and unscheduled on
another for long. The score of a mode is the mean over jobs of its rate
relative to the other mode's, so a small job counts as much as a large one.
Grants are kept only when they are ahead by `margin`: the promise is never
to be slower than sharing without us. Where the jobs differ in priority class,
only the highest class's jobs score (`scored`): grants stay only where they
pay the job that matters, which is the one a priority promises its speed.

Pure: the wall time and the jobs' iteration counts come in as arguments.
"""
from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, field

__all__ = ["Mode", "PayoffSettings", "PayoffJudge", "Verdict"]


class Mode(enum.Enum):
    SCHEDULED = "scheduled"
    UNSCHEDULED = "unscheduled"


@dataclass(frozen=True)
class PayoffSettings:
    """`window_s`: one measuring window (aligned on the wall clock); `settle_share`: the share of it left
    out of the measure at its start, while a switch takes effect; `probe_pairs`: scheduled and unscheduled
    windows per probe;
    `hold_windows`: windows a verdict stands before the next probe; `margin`: how far ahead grants must be
    to be kept."""

    window_s: float = 3.0
    settle_share: float = 0.25
    probe_pairs: int = 2
    hold_windows: int = 20
    margin: float = 0.01

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not 0 <= self.settle_share < 1:
            raise ValueError(f"window {self.window_s}s with settle share {self.settle_share}: need a window > 0 "
                             "and 0 <= settle share < 1")
        if self.probe_pairs < 1 or self.hold_windows < 1:
            raise ValueError("probe_pairs and hold_windows must be >= 1")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin {self.margin}: must be within [0, 1)")


@dataclass(frozen=True)
class Verdict:
    """A device's mode and why: `score` is scheduled's progress relative to unscheduled's at the last probe
    (None: not measured yet); `probing`: the mode is one window of a probe, not a verdict."""

    mode: Mode
    reason: str
    score: float | None = None
    probing: bool = False


@dataclass
class _Window:
    """The window being measured: its index, its mode, its first and latest (wall, progress) samples."""

    index: int
    mode: Mode
    start: tuple[float, dict[str, int]]
    last: tuple[float, dict[str, int]]


@dataclass
class PayoffJudge:
    """One device's probe-and-keep rule. Call `sample` often (every few hundred ms) with the wall time
    and each job's iteration count on the device; it returns the mode the device should be in."""

    settings: PayoffSettings = field(default_factory=PayoffSettings)
    verdict: Verdict = field(default_factory=lambda: Verdict(Mode.SCHEDULED, "one job or none: nothing to share"))
    _jobs: frozenset[str] = frozenset()
    _scored: frozenset[str] = frozenset()
    _probe_from: int | None = None  # first window of the current probe
    _hold_until: int | None = None  # the window the kept verdict ends at
    _window: _Window | None = None
    _rates: dict[Mode, list[dict[str, float]]] = field(default_factory=lambda: {m: [] for m in Mode})

    def sample(self, wall: float, progress: dict[str, int], scored: frozenset[str] | None = None) -> Verdict:
        """The device's verdict at `wall` (seconds), given each job's iteration count (its fastest rank's).

        `scored`: the jobs whose progress decides (None: every job). A change in the jobs or in which of
        them score starts a new probe."""
        s = self.settings
        w = math.floor(wall / s.window_s)
        jobs = frozenset(progress)
        judged = jobs if scored is None else jobs & scored
        if (jobs, judged) != (self._jobs, self._scored):
            self._jobs, self._scored = jobs, judged
            self._start_probe(w)
        if len(jobs) < 2:
            self._probe_from = self._hold_until = None
            self._window = None
            self.verdict = Verdict(Mode.SCHEDULED, "one job or none: nothing to share")
            return self.verdict
        if self._hold_until is not None and w >= self._hold_until:
            self._start_probe(w)
        if self._window is not None and w != self._window.index:
            self._close_window()
        if self._probe_from is not None and w >= self._probe_from:
            k = w - self._probe_from
            if k >= 2 * s.probe_pairs:
                self._decide(w)
            else:
                mode = Mode.SCHEDULED if k % 2 == 0 else Mode.UNSCHEDULED
                self.verdict = Verdict(mode, f"probing: window {k + 1} of {2 * s.probe_pairs}", self.verdict.score,
                                       probing=True)
        if self.verdict.probing:
            self._measure(w, wall - w * s.window_s, wall, progress)
        return self.verdict

    def hold(self, verdict: Verdict) -> Verdict:
        """Take `verdict` as the device's mode, decided elsewhere (weights need grants): the next `sample`
        starts a probe afresh (forgetting the jobs makes it see them change)."""
        self._jobs = self._scored = frozenset()
        self.verdict = verdict
        return verdict

    def _start_probe(self, w: int) -> None:
        """Probe from the next even window: every node starts its probe in the same window."""
        self._probe_from = w + 1 + (w + 1) % 2
        self._hold_until = None
        self._window = None
        self._rates = {m: [] for m in Mode}
        if self.verdict.probing:  # a probe cut short: run scheduled until the next one starts
            self.verdict = Verdict(Mode.SCHEDULED, "the jobs changed: probing again", self.verdict.score)

    def _measure(self, w: int, offset: float, wall: float, progress: dict[str, int]) -> None:
        if offset < self.settings.settle_share * self.settings.window_s:
            return
        sample = (wall, dict(progress))
        if self._window is None:
            self._window = _Window(w, self.verdict.mode, start=sample, last=sample)
        self._window.last = sample

    def _close_window(self) -> None:
        win, self._window = self._window, None
        if win is None:
            return
        (t0, p0), (t1, p1) = win.start, win.last
        if t1 - t0 < 0.25 * self.settings.window_s:
            return
        self._rates[win.mode].append({j: (p1[j] - p0[j]) / (t1 - t0) for j in p0 if j in p1})

    def _decide(self, w: int) -> None:
        score = _score(self._rates[Mode.SCHEDULED], self._rates[Mode.UNSCHEDULED], self._scored)
        self._probe_from = None
        self._hold_until = w + self.settings.hold_windows
        whose = "the progress" if self._scored == self._jobs else "the highest class's progress"
        if score is None:
            self.verdict = Verdict(Mode.SCHEDULED, "probe measured nothing (jobs idle): scheduled", None)
        elif score >= 1 + self.settings.margin:
            self.verdict = Verdict(Mode.SCHEDULED, f"grants pay: {score:.2f}x {whose} unscheduled", score)
        else:
            self.verdict = Verdict(Mode.UNSCHEDULED, f"grants do not pay: {score:.2f}x {whose} unscheduled",
                                   score)


def _score(scheduled: list[dict[str, float]], unscheduled: list[dict[str, float]],
           jobs: frozenset[str]) -> float | None:
    """Mean over `jobs` of (median rate scheduled / median rate unscheduled); None without both measures."""
    ratios = []
    for job in jobs if scheduled and unscheduled else ():
        a = [r[job] for r in scheduled if job in r]
        b = [r[job] for r in unscheduled if job in r]
        if a and b and statistics.median(b) > 0:
            ratios.append(statistics.median(a) / statistics.median(b))
    return statistics.fmean(ratios) if ratios else None
