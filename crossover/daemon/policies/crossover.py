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
"""
from __future__ import annotations

from dataclasses import dataclass

from crossover.daemon.api import RankKey
from crossover.daemon.policies._queues import DispatchPolicy, _Device

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

    def __init__(self, settings: CrossoverSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or CrossoverSettings()
        self._compute: dict[str, float] = {}  # job id -> EMA of its compute phases on this node
        self._passed: dict[RankKey, int] = {}  # waiting rank -> times a later request went first
        self.overtakes = 0

    def decisions(self) -> dict[str, int]:
        return {"overtake": self.overtakes}

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        self._passed.pop(key, None)
        if not any(k.job_id == key.job_id for k in self._q.ranks if k != key):
            self._compute.pop(key.job_id, None)
        return super().leave(key, now)

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._passed.pop(key, None)
        return super().cancel(key, now)

    def _joined(self, key: RankKey) -> None:
        self._passed.pop(key, None)

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        if phase != "compute" or duration_s <= 0 or key not in self._q.ranks:
            return
        old = self._compute.get(key.job_id)
        a = self.settings.ema_alpha
        self._compute[key.job_id] = duration_s if old is None else (1 - a) * old + a * duration_s

    def order(self, device: int) -> list[RankKey]:
        """The device's waiting ranks in the order they would be served if nothing else happened."""
        dev = self._q.devices.get(device)
        if dev is None:
            return []
        waiting = list(dev.waiting)
        passed = {k: self._passed.get(k, 0) for k in waiting}
        out = []
        while waiting:
            nxt = self._pick(waiting, passed)
            self._pass_over(waiting, passed, nxt)
            waiting.remove(nxt)
            out.append(nxt)
        return out

    def _order(self, device: int) -> tuple[str, ...]:
        """Job names on the device: the waiting ones in serve order, then the others (holding the
        device or in their allreduce) by job id, as `crossover queue` shows them."""
        names = {k: r.job_name for k, r in self._q.ranks.items() if r.device == device}
        waiting = [names[k] for k in self.order(device)]
        rest = [names[k] for k in sorted(names, key=lambda k: (k.job_id, k.rank))]
        return tuple(dict.fromkeys(waiting + rest))

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
        waiting = list(dev.waiting)
        nxt = self._pick(waiting, self._passed)
        if self._pass_over(waiting, self._passed, nxt):
            self.overtakes += 1
        self._passed.pop(nxt, None)
        self._q.grant(dev, nxt)
        return [nxt]
