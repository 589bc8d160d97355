"""`crossover`: co-located jobs take turns on each device in one cluster-wide cyclic order.

While job A computes, job B runs its allreduce; then they swap (CrossoverScheduler,
Luo et al. 2021). Generalized to N jobs with unequal phase times:

* Order. On every device the jobs are ordered by `job_id`, an identity every
  node sees identically. After job X's compute phase, the turn passes to the
  job whose id follows X's, cyclically. The successor depends only on which
  job was served last, so every node that served the same job picks the same
  next one ("crossover synchronization") without exchanging a message, and a
  node that joined late or lost a job converges after one turn.
* Bounded waiting. If the job whose turn it is has not asked for the device,
  the device is held for it at most `max_wait` seconds: by default the time
  its allreduce is expected to take still (EMA of its measured comm phase,
  times `slack`), clamped to [`min_wait_s`, `max_wait_s`]. After that the next
  ready job in order is served, so a stalled or departed job never stalls the
  device, and nobody starves: a waiting rank is served within one cycle of
  (number of jobs) × (longest compute + longest bounded wait).
* No deadlock. The policy never withholds a device without a deadline: either
  a rank holds it (its compute phase ends, or its death frees it), or a
  bounded wait for the turn's owner is running. So no chain of ranks waiting
  on each other across nodes can be permanent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..api import RankKey, RankRef
from ._queues import QueuePolicy, _Device

__all__ = ["CrossoverPolicy", "CrossoverSettings"]


@dataclass(frozen=True)
class CrossoverSettings:
    slack: float = 1.5
    min_wait_s: float = 0.002
    max_wait_s: float = 0.5
    initial_wait_s: float = 0.05  # before a job's comm time has been measured
    ema_alpha: float = 0.3


@dataclass
class _Turn:
    last_job: str | None = None  # job served last on this device
    owner: str | None = None  # job whose turn it is now
    deadline: float | None = None  # when waiting for `owner` gives up
    skipped: int = 0


@dataclass
class _JobTiming:
    comm_ema: float | None = None
    compute_ema: float | None = None
    comm_began: dict[RankKey, float] = field(default_factory=dict)


class CrossoverPolicy(QueuePolicy):
    """Cyclic, cluster-consistent turn-taking with bounded waiting. Pure: time only through `now`."""

    name = "crossover"
    blocks = True

    def __init__(self, settings: CrossoverSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or CrossoverSettings()
        self._turns: dict[int, _Turn] = {}
        self._timing: dict[str, _JobTiming] = {}
        self._names: dict[str, str] = {}

    # ---- events -----------------------------------------------------------

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._q.add(rank)
        self._turns.setdefault(rank.device, _Turn())
        self._timing.setdefault(rank.key.job_id, _JobTiming())
        self._names[rank.key.job_id] = rank.job_name
        return self._dispatch(rank.device, now)

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        device = self._q.remove(key)
        if not any(k.job_id == key.job_id for k in self._q.ranks):
            self._timing.pop(key.job_id, None)
            self._names.pop(key.job_id, None)
        return self._dispatch(device, now)

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._q.enqueue(key, now)
        timing = self._timing.get(key.job_id)
        if timing is not None:
            timing.comm_began.pop(key, None)
        return self._dispatch(self._q.ranks[key].device, now)

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.release(key)
        device = self._q.ranks[key].device
        turn = self._turns[device]
        turn.last_job = key.job_id
        turn.owner = None
        turn.deadline = None
        timing = self._timing[key.job_id]
        timing.comm_began[key] = now
        return self._dispatch(device, now)

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.cancel(key)
        return self._dispatch(self._q.ranks[key].device, now)

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        timing = self._timing.get(key.job_id)
        if timing is None or duration_s <= 0:
            return
        a = self.settings.ema_alpha
        if phase == "comm":
            timing.comm_ema = duration_s if timing.comm_ema is None else (1 - a) * timing.comm_ema + a * duration_s
        elif phase == "compute":
            timing.compute_ema = (duration_s if timing.compute_ema is None
                                  else (1 - a) * timing.compute_ema + a * duration_s)

    def tick(self, now: float) -> list[RankKey]:
        granted: list[RankKey] = []
        for device, turn in self._turns.items():
            if turn.deadline is not None and now >= turn.deadline:
                granted += self._dispatch(device, now)
        return granted

    # ---- queries ------------------------------------------------------------

    def order(self, device: int) -> list[str]:
        """Job ids present on the device, in turn order starting with the job whose turn is next."""
        jobs = self._jobs_on(device)
        if not jobs:
            return []
        turn = self._turns.get(device, _Turn())
        first = turn.owner or self._successor(jobs, turn.last_job)
        i = jobs.index(first)
        return jobs[i:] + jobs[:i]

    def _order(self, device: int) -> tuple[str, ...]:
        return tuple(self._names.get(j, j) for j in self.order(device))

    # ---- decisions ----------------------------------------------------------

    def _jobs_on(self, device: int) -> list[str]:
        return sorted({k.job_id for k, r in self._q.ranks.items() if r.device == device})

    @staticmethod
    def _successor(jobs: list[str], last: str | None) -> str:
        if last is None:
            return jobs[0]
        for j in jobs:
            if j > last:
                return j
        return jobs[0]

    def _expected_wait(self, job: str, now: float) -> float:
        s = self.settings
        timing = self._timing.get(job)
        if timing is None or timing.comm_ema is None:
            wait = s.initial_wait_s
        else:
            began = max(timing.comm_began.values(), default=now)
            wait = max(0.0, began + s.slack * timing.comm_ema - now)
        return min(s.max_wait_s, max(s.min_wait_s, wait))

    def _dispatch(self, device: int, now: float) -> list[RankKey]:
        dev = self._q.devices.get(device)
        turn = self._turns.get(device)
        if dev is None or turn is None or dev.holders:
            return []
        jobs = self._jobs_on(device)
        if not jobs:
            turn.owner, turn.deadline = None, None
            return []
        if turn.owner not in jobs:
            turn.owner = self._successor(jobs, turn.last_job)
            turn.deadline = None
        owner_rank = self._first_waiting(dev, turn.owner)
        if owner_rank is not None:
            return self._grant(dev, turn, owner_rank)
        if not dev.waiting:
            return []
        if turn.deadline is None:
            turn.deadline = now + self._expected_wait(turn.owner, now)
        if now < turn.deadline:
            return []
        # The owner is late: serve the next ready job in order after it.
        i = jobs.index(turn.owner)
        for job in jobs[i + 1:] + jobs[:i]:
            rank = self._first_waiting(dev, job)
            if rank is not None:
                turn.skipped += 1
                return self._grant(dev, turn, rank)
        return []

    @staticmethod
    def _first_waiting(dev: _Device, job: str) -> RankKey | None:
        for k in dev.waiting:
            if k.job_id == job:
                return k
        return None

    def _grant(self, dev: _Device, turn: _Turn, key: RankKey) -> list[RankKey]:
        self._q.grant(dev, key)
        turn.owner = key.job_id
        turn.deadline = None
        return [key]
