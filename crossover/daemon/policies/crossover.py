"""`crossover`: each device serves co-located jobs in the order their allreduces ended, short computes first.

While job A computes, job B runs its allreduce; when B's allreduce ends, B asks
for the device and gets it as soon as A releases (CrossoverScheduler, Luo et al.
2021). The rule that does this on every node at once:

* Request order is the cluster-wide order. A job's ranks all ask for their
  devices when the job's allreduce ends, which is one moment for every rank of
  the job (up to the network's skew). So serving each device in request order
  gives every node the same order without a message between daemons, and all
  ranks of a job get their devices in the same round. Requests within `tie_s`
  of each other (jobs that start together, identical jobs in step) go in job-id
  order, which every node shares, instead of in whichever order the skew gave. Nothing is kept per job
  across iterations, so a job that arrives, pauses or leaves changes nobody's
  order but its own.
* Work-conserving. A free device with a waiting rank is granted at once. The
  policy never keeps a device for a job expected back: measured on the
  simulator, those bounded waits cost co-located jobs more than any ordering
  bought (docs/policies.md, "Why the turn rotation lost").
* Short compute first, within a bound. A waiting job whose measured compute
  phase (EMA) is under `short_gap` x that of the first request in line goes
  before it, the shortest first. Serving the shorter phase first shortens the
  mean wait on the device (shortest-processing-time order), and a job's
  iteration waits for its most-delayed rank on any device, so shorter waits
  everywhere shorten iterations everywhere. The gap keeps nodes in agreement:
  a job's phases measured on two nodes differ by its ranks' spread and jitter,
  and only a clear difference reorders.
* No starvation. A request is passed over by at most `max_overtakes` later
  ones; then it is served before any other. Every waiting rank is therefore
  served after finitely many grants: the first in line within
  `max_overtakes` + 1, and each rank behind it moves up when it is served.
* No deadlock. No device idles while a rank waits for it, so no chain of ranks
  waiting on each other across nodes can form that the next release does not
  break.

`CrossoverSettings(short_gap=0)` is plain first-come, first-served (the
`exclusive` policy's order).

Jobs of different priority classes or weights on one device are served by the
class rules instead (`policies.classes`): higher classes first, lower ones only
into gaps they fit (or cut to the gap: asked to yield when it closes), a yield asked of a lower holder
when a higher rank asks,
weights within a class and a guaranteed share for every lower job, all within the
budget that the device's isolation controller sets from the highest class's own pace
(`policies.isolation`). While a device's jobs are all of one class and weight,
nothing above changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies._queues import DispatchPolicy, _Device
from crossover.daemon.policies.classes import ClassBook, ClassSettings, JobClass
from crossover.daemon.policies.isolation import AlonePace, Change, IsolationController, IsolationView

__all__ = ["CrossoverPolicy", "CrossoverSettings"]


@dataclass(frozen=True)
class CrossoverSettings:
    """`short_gap`: how much shorter a job's compute must be to go first (0: never);
    `max_overtakes`: how often one request may be passed over; `ema_alpha`: weight of
    the newest compute phase in the measured mean; `tie_s`: requests this close to the
    first in line count as simultaneous and go in job-id order (nodes see one moment a
    few milliseconds apart)."""

    short_gap: float = 0.7
    max_overtakes: int = 1
    ema_alpha: float = 0.3
    tie_s: float = 0.002

    def __post_init__(self) -> None:
        if not 0.0 <= self.short_gap <= 1.0:
            raise ValueError(f"short_gap {self.short_gap}: must be within [0, 1]")
        if self.max_overtakes < 0:
            raise ValueError(f"max_overtakes {self.max_overtakes}: must be >= 0")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha {self.ema_alpha}: must be within (0, 1]")
        if self.tie_s < 0:
            raise ValueError(f"tie_s {self.tie_s}: must be >= 0")


class CrossoverPolicy(DispatchPolicy):
    """Request order with short computes first and bounded overtaking. Pure: time only through `now`."""

    name = "crossover"
    blocks = True

    def __init__(self, settings: CrossoverSettings | None = None, classes: ClassSettings | None = None,
                 wall_offset: float = 0.0) -> None:
        super().__init__()
        self.settings = settings or CrossoverSettings()
        self.book = ClassBook(classes)
        self.wall_offset = wall_offset  # the wall clock minus `now`'s: isolation windows align across nodes
        self.isolation: dict[int, IsolationController] = {}  # device -> its controller, while classes differ
        self._alone: dict[int, AlonePace] = {}  # device -> its jobs' pace while no lower class shares it
        self._isolation_changes: list[tuple[int, Change]] = []
        self._compute: dict[str, float] = {}  # job id -> EMA of its compute phases on this node
        self._passed: dict[RankKey, int] = {}  # waiting rank -> times a later request went first
        self._now = 0.0  # the `now` of the event being decided
        self._granted_at: dict[RankKey, float] = {}
        self._preempt: list[RankKey] = []  # holders to ask for a yield, not yet taken
        self._asked: set[RankKey] = set()  # holders asked during their current grant
        self._paid: set[RankKey] = set()  # holders the floor or the guard served: not asked to yield that phase
        self._held_until: dict[int, float] = {}  # device -> when a held-back lower phase is looked at again
        self._cut_at: dict[int, float] = {}  # device -> when its lower holders, in a cut turn, are asked to yield
        self._asked_at: dict[RankKey, float] = {}  # holder -> when it was asked to yield
        self._answered: dict[RankKey, float] = {}  # rank -> how long after the ask it released (yield or end?)
        self._since: dict[RankKey, tuple[int, float]] = {}  # rank -> (its iteration, when it first asked for it)
        self.overtakes = 0
        self.preemptions = 0
        self.held_back = 0
        self.guarded = 0
        self.budgeted = 0  # lower phases held back by the isolation budget
        self.starved = 0  # lower phases served by the isolation controller's floor
        self.cut = 0  # lower phases granted a gap they do not fit, cut to it

    def decisions(self) -> dict[str, int]:
        return {"overtake": self.overtakes, "preempt": self.preemptions, "held_back": self.held_back,
                "guard": self.guarded, "budget": self.budgeted, "floor": self.starved, "cut": self.cut}

    # ---- classes ---------------------------------------------------------

    def classify(self, job_id: str, cls: JobClass, now: float) -> list[RankKey]:
        """Set a job's class (and weight); the devices it is on decide again."""
        self._now = now
        self.book.classes[job_id] = cls
        granted: list[RankKey] = []
        for index in sorted({r.device for k, r in self._q.ranks.items() if k.job_id == job_id}):
            granted += self._decide(self._q.devices[index])
        return granted

    def take_preemptions(self) -> list[RankKey]:
        """Holders of a lower class that a higher-class rank now waits behind: ask each to yield (once a grant)."""
        out, self._preempt = self._preempt, []
        return out

    def take_isolation_changes(self) -> list[tuple[int, Change]]:
        """The isolation budgets changed since the last call, per device (each an `isolation` event)."""
        out, self._isolation_changes = self._isolation_changes, []
        return out

    def isolating(self, device: int) -> bool:
        return device in self.isolation

    def isolation_view(self, device: int) -> IsolationView | None:
        ctl = self.isolation.get(device)
        if ctl is None:
            return None
        names = {k.job_id: r.job_name for k, r in self._q.ranks.items()}
        since = self._now - ctl.settings.window_s
        return ctl.view({names.get(j, j): self.book.held_since({j}, since, device) for j in sorted(ctl.lower)})

    # ---- events ----------------------------------------------------------

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._now = now
        return super().join(rank, now)

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        ref = self._q.ranks.get(key)
        if ref is not None and ref.device in self.isolation:  # a device left without lower jobs drops its controller
            self._isolate(ref.device, self._jobs_on(ref.device, without=key))
        self._passed.pop(key, None)
        self._granted_at.pop(key, None)
        self._asked.discard(key)
        self._paid.discard(key)
        self._asked_at.pop(key, None)
        self._answered.pop(key, None)
        self._since.pop(key, None)
        self._preempt = [k for k in self._preempt if k != key]
        if not any(k.job_id == key.job_id for k in self._q.ranks if k != key):
            self._compute.pop(key.job_id, None)
            self.book.forget(key.job_id)
        return super().leave(key, now)

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._now = now
        again = key in self._since and self._since[key][0] == iteration  # after a yield
        after = self._answered.pop(key, None)
        # A phase that ended about as soon after the ask as a yield would have says nothing either way.
        if after is not None and (again or after > 2 * self.book.yield_lead(key.job_id) + 0.005):
            self.book.answered(key.job_id, after, yielded=again)
        if not again:
            self._since[key] = (iteration, now)
        ref = self._q.ranks.get(key)
        if ref is not None and self.book.settings.isolation.on:
            jobs = self._jobs_on(ref.device)
            ctl = self._isolate(ref.device, jobs)
            if ctl is not None:
                ctl.request(key.job_id, iteration, now)
            else:
                alone = self._alone.setdefault(ref.device, AlonePace())
                alone.forget(jobs)
                alone.request(key.job_id, iteration, now)
        granted = super().request(key, iteration, now)
        dev = self._q.device_of(key)
        mine = self.book.of(key.job_id).priority
        if key in dev.waiting and any(self.book.of(h.job_id).priority < mine and self._long_left(h, now)
                                      for h in dev.holders):
            self._ask(dev.holders)
        return granted

    def _ask(self, holders: list[RankKey]) -> None:
        """Ask each holder not yet asked in its grant (and not paid for by the floor or the guard) to yield."""
        fresh = [h for h in holders if h not in self._asked and h not in self._paid]
        self._asked.update(fresh)
        self._asked_at.update(dict.fromkeys(fresh, self._now))
        self._preempt += fresh
        self.preemptions += bool(fresh)

    def _long_left(self, holder: RankKey, now: float) -> bool:
        """Whether the holder is expected to hold on for long enough that a yield is worth its hand-over:
        more than a tenth of its measured phase (at least 5 ms) left. A holder about to release anyway is
        left to it: yielding it then only moves its allreduce onto the higher job's."""
        c = self._compute.get(holder.job_id)
        began = self._granted_at.get(holder)
        if c is None or began is None:
            return True
        return self._worth_a_handover(holder.job_id, c - (now - began))

    def _worth_a_handover(self, job: str, left_s: float) -> bool:
        """Whether `left_s` of the job's device time is worth a hand-over: more than a tenth of its measured
        phase, and at least 5 ms."""
        return left_s > max(0.005, 0.1 * self._compute.get(job, 0.0))

    def occupy(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._now = now
        self._granted_at[key] = now
        self._since[key] = (iteration, now)
        return super().occupy(key, iteration, now)

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        began = self._granted_at.pop(key, None)
        if began is not None:
            ref = self._q.ranks.get(key)
            self.book.served(key.job_id, now - began, now, -1 if ref is None else ref.device)
        self._asked.discard(key)
        self._paid.discard(key)
        asked = self._asked_at.pop(key, None)
        if asked is not None:
            self._answered[key] = now - asked
        return super().release(key, now)

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        self._passed.pop(key, None)
        return super().cancel(key, now)

    def tick(self, now: float) -> list[RankKey]:
        """Ask the holders of cut turns whose gap closes now to yield; look again at devices whose lower-class
        phase was held back until now."""
        self._now = now
        for index, at in sorted(self._cut_at.items()):
            if at <= now:
                del self._cut_at[index]
                top = max((self.book.of(j).priority for j in self._jobs_on(index)), default=0)
                self._ask([h for h in self._q.devices[index].holders
                           if self.book.of(h.job_id).priority < top and self._long_left(h, now)])
        granted: list[RankKey] = []
        for index, until in sorted(self._held_until.items()):
            if until <= now:
                del self._held_until[index]
                granted += self._decide(self._q.devices[index])
        return granted

    def next_deadline(self) -> float | None:
        return min([*self._held_until.values(), *self._cut_at.values()], default=None)

    def _mates(self, dev: _Device) -> list[RankKey]:
        """None while a holder is asked to yield or a rank of a higher class than the holders' waits: a rank
        that yielded and asks again would otherwise be granted back beside its job's other rank at once."""
        if any(h in self._asked for h in dev.holders):
            return []
        held = max((self.book.of(h.job_id).priority for h in dev.holders), default=None)
        if held is not None and any(self.book.of(k.job_id).priority > held for k in dev.waiting):
            return []
        return super()._mates(dev)

    def _joined(self, key: RankKey) -> None:
        self._passed.pop(key, None)
        self._granted_at[key] = self._now

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        if duration_s <= 0 or key not in self._q.ranks:
            return
        a = self.settings.ema_alpha
        if phase == "comm":
            self.book.observe_comm(key.job_id, duration_s, a)
            return
        if phase != "compute":
            return
        self.book.observe_compute(key.job_id, duration_s)
        old = self._compute.get(key.job_id)
        self._compute[key.job_id] = duration_s if old is None else (1 - a) * old + a * duration_s

    def order(self, device: int) -> list[RankKey]:
        """The device's waiting ranks in the order they would be served if nothing else happened."""
        dev = self._q.devices.get(device)
        if dev is None:
            return []
        waiting = list(dev.waiting)
        # classes: higher first, then request order (gaps and the guard aside)
        if not self.book.uniform(self._jobs_on(device)):
            at = self._q.requested_at
            return sorted(waiting, key=lambda k: (-self.book.of(k.job_id).priority, at[k], k.job_id, k.rank))
        passed = {k: self._passed.get(k, 0) for k in waiting}
        out = []
        while waiting:
            nxt = self._pick(waiting, passed)
            self._pass_over(waiting, passed, nxt)
            waiting.remove(nxt)
            out.append(nxt)
        return out

    def _order(self, device: int) -> tuple[str, ...]:
        """Job names on the device, as `crossover queue` shows them: the waiting ones in serve order, then the
        others (holding the device or in their allreduce) by job id. Where classes differ, a higher job comes
        back before a lower one is served (it waits only for a gap it fits, or its guard), so the order is by
        class first, a lower job whose guard is due now first of all."""
        names = {k: r.job_name for k, r in self._q.ranks.items() if r.device == device}
        serve = self.order(device)
        keys = serve + [k for k in sorted(names, key=lambda k: (k.job_id, k.rank)) if k not in serve]
        if not self.book.uniform({k.job_id for k in names}):
            owed = {k for k in serve if self.book.credit(k.job_id, self._now) >= self._guard_need(k.job_id)}
            keys.sort(key=lambda k: (k not in owed, -self.book.of(k.job_id).priority))  # stable: serve order within
        return tuple(dict.fromkeys(names[k] for k in keys))

    def _pick(self, waiting: list[RankKey], passed: dict[RankKey, int]) -> RankKey:
        """The rank to serve next among `waiting`: the first in line unless a clearly shorter job may pass it."""
        at = self._q.requested_at
        by_time = sorted(waiting, key=lambda k: (at[k], k.job_id, k.rank))
        first = at[by_time[0]]
        head = min((k for k in by_time if at[k] <= first + self.settings.tie_s), key=lambda k: (k.job_id, k.rank))
        by_time.remove(head)
        by_time.insert(0, head)
        head_c = self._compute.get(head.job_id)
        if head_c is None or passed.get(head, 0) >= self.settings.max_overtakes:
            return head
        limit = self.settings.short_gap * head_c
        shorter = [k for k in by_time[1:] if self._compute.get(k.job_id, limit) < limit]
        chosen = min(shorter, key=lambda k: self._compute[k.job_id]) if shorter else head  # stable: earliest
        return self._refine(by_time, chosen)

    def _refine(self, by_time: list[RankKey], chosen: RankKey) -> RankKey:
        """The last word on a choice that may pass the first in line (`by_time`: the waiting ranks in
        request order). Here `chosen` itself; the simulator's `crossover-link` variant overrides it."""
        return chosen

    def _pass_over(self, waiting: list[RankKey], passed: dict[RankKey, int], chosen: RankKey) -> int:
        """Count one overtake against every rank that asked before `chosen`; returns how many."""
        t = self._q.requested_at[chosen] - self.settings.tie_s
        earlier = [k for k in waiting if k != chosen and self._q.requested_at[k] < t]
        for k in earlier:
            passed[k] = passed.get(k, 0) + 1
        return len(earlier)

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        if dev.holders or not dev.waiting:
            return []
        self._held_until.pop(dev.index, None)
        self._cut_at.pop(dev.index, None)
        waiting = list(dev.waiting)
        jobs = self._jobs_on(dev.index)
        if not self.book.uniform(jobs):
            classed = self._by_class(dev, waiting, jobs)
            if classed is None:
                return []
            nxt, waiting = classed
        else:
            nxt = self._pick(waiting, self._passed)
        if nxt in waiting and self._pass_over(waiting, self._passed, nxt):
            self.overtakes += 1
        self._passed.pop(nxt, None)
        self._q.grant(dev, nxt)
        self._granted_at[nxt] = self._now
        return [nxt]

    def _guard_need(self, job: str) -> float:
        """The credit a job's guard must hold before it serves the job's next phase: that phase (at least 10 ms),
        or all it can save up where the phase is longer (the phase then overdraws it, and the job pays the rest
        back before its next); never, without a guard (`guard_share` 0)."""
        if self.book.settings.guard_share <= 0:
            return math.inf
        return min(max(self._compute.get(job, 0.0), 0.01), self.book.credit_cap)

    def _jobs_on(self, device: int, without: RankKey | None = None) -> set[str]:
        """The jobs with a rank on `device` (but for the rank `without`, which is leaving)."""
        return {k.job_id for k, r in self._q.ranks.items() if r.device == device and k != without}

    def _guard(self, ranks: list[RankKey], due: list[float]) -> RankKey | None:
        """The earliest of `ranks` whose guaranteed share covers its next phase (the guard serves it, and the
        phase is not asked to yield: a guaranteed phase cut at each return of the higher job would never end
        where it leaves no gaps); None, after adding to `due` when each will be owed one."""
        book, at = self.book, self._q.requested_at
        for k in sorted(ranks, key=lambda k: (at[k], k.job_id, k.rank)):
            need = self._guard_need(k.job_id)
            credit = book.credit(k.job_id, self._now)
            if credit >= need:
                self.guarded += 1
                self._paid.add(k)  # its credit pays for the whole phase: a higher rank back meanwhile waits
                return k
            due.append(self._now + (need - credit) / max(book.settings.guard_share, 1e-9))
        return None

    def _cut_turn(self, dev: _Device, ranks: list[RankKey], closes_at: float) -> RankKey | None:
        """The earliest of `ranks` (lower phases that do not fit the gap that closes at `closes_at`) whose job
        yields when asked and for which the gap left, less its lead, is worth a hand-over;
        it is granted the gap, and its device's holders asked to yield `yield_lead` before the gap closes."""
        book, at = self.book, self._q.requested_at
        for k in sorted(ranks, key=lambda k: (at[k], k.job_id, k.rank)):
            cut_at = closes_at - book.yield_lead(k.job_id)
            if book.yields_promptly(k.job_id) and self._worth_a_handover(k.job_id, cut_at - self._now):
                self._cut_at[dev.index] = cut_at
                self.cut += 1
                return k
        return None

    def _isolate(self, index: int, jobs: set[str]) -> IsolationController | None:
        """The device's isolation controller, stepped to `now`, while its jobs differ in priority (not only in
        weight) and `--protect` is on; None otherwise."""
        settings = self.book.settings.isolation
        priority = {j: self.book.of(j).priority for j in jobs}
        top = max(priority.values(), default=0)
        protected = frozenset(j for j, p in priority.items() if p == top)
        lower = frozenset(jobs) - protected
        if not settings.on or not lower:
            self.isolation.pop(index, None)
            return None
        ctl = self.isolation.get(index)
        if ctl is None:
            alone = self._alone.pop(index, None)
            ctl = self.isolation[index] = IsolationController(settings, self.wall_offset)
            ctl.alone_s = {} if alone is None else alone.iteration_s(self._now)
        change = ctl.step(protected, lower, self._now)
        if change is not None:
            self._isolation_changes.append((index, change))
        return ctl

    def _by_class(self, dev: _Device, waiting: list[RankKey], jobs: set[str]
                  ) -> tuple[RankKey, list[RankKey]] | None:
        """The class rules' choice on a device whose jobs differ in class or weight, with the ranks it was
        chosen among (overtakes count only among those); None: hold the device back for a higher job."""
        now, book, at = self._now, self.book, self._q.requested_at
        due: list[float] = []  # when a held-back lower rank is owed its phase (by the guard, or the floor)
        ctl = self._isolate(dev.index, jobs)
        if ctl is not None:
            w = ctl.settings.window_s
            held = book.held_since(ctl.lower, now - w, dev.index)
            starve_s = ctl.settings.starve_windows * w
            since = {k: self._since[k][1] if k in self._since else at[k]
                     for k in dev.waiting if k.job_id in ctl.lower}
            if since:  # the floor falls due for the lower rank that has waited longest (its yields do not restart it)
                due.append(min(since.values()) + starve_s)
            starving = {k for k in waiting if k in since and since[k] + starve_s <= now}
            kept_out = [k for k in waiting if k.job_id in ctl.lower
                        and not ctl.allows(held, self._compute.get(k.job_id, 0.0), k in starving)]
            if kept_out:
                waiting = [k for k in waiting if k not in kept_out]
                if not waiting:  # look again when the window ends, when some held time has aged out, or at the floor
                    self.budgeted += 1
                    self._held_until[dev.index] = min(ctl.next_boundary(now), now + w / 10,
                                                      *(t for t in due if t > now))
                    return None
            starving -= set(kept_out)  # a solo window keeps even a starving rank out
            if starving:  # the floor: its whole phase now, gap or not, so that it never waits past its grant timeout
                self.starved += 1
                chosen = min(starving, key=lambda k: (at[k], k.job_id, k.rank))
                self._paid.add(chosen)
                return chosen, []
        top = max(book.of(k.job_id).priority for k in waiting)
        owed = self._guard([k for k in waiting if book.of(k.job_id).priority < top], due)
        if owed is not None:
            return owed, []
        cands = [k for k in waiting if book.of(k.job_id).priority == top]
        higher = [j for j in jobs if book.of(j).priority > top]
        backs = [t for j in higher if (t := book.back_at(j, now)) is not None]
        if backs and not math.isinf(book.settings.fit_margin):  # inf: any gap (the rule off)
            gap = (min(backs) - now) * book.settings.fit_margin
            fits = [k for k in cands if (book.long_phase(k.job_id) or 0.0) <= gap]
            if not fits:
                # A lower job whose guaranteed share is due takes it now, while the higher job is away,
                # rather than when the higher job waits: it then costs the overrun, not a whole phase.
                owed = self._guard(cands, due)
                if owed is not None:
                    return owed, []
                cut = self._cut_turn(dev, cands, min(backs)) if book.settings.cut_turns else None
                if cut is not None:
                    return cut, []
                self.held_back += 1
                opens = [t for j in higher if (t := book.opens_at(j)) is not None]
                self._held_until[dev.index] = min([max(opens, default=now) + 1e-3, *(t for t in due if t > now)])
                return None
            cands = fits
        if len({book.of(k.job_id).weight for k in cands}) > 1:
            return min(cands, key=lambda k: (book.recent(k.job_id) / book.of(k.job_id).weight, at[k], k.job_id,
                                             k.rank)), cands
        return self._pick(cands, self._passed), cands
