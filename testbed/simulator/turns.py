"""`turns`, a retired policy the simulator keeps for comparison: one cluster-wide rotation by iteration.

The daemon ran it until protocol 2; it lost to `crossover` on every measured
bed (docs/policies.md, "Why the turn rotation lost"), and its start-up
agreement (a job-wide collective and a TurnFloor call before every job's first
request) cost the default path. The simulator calls `turn_floor` itself and
hands every request `base + iteration`, as the plugin used to.

While job A computes, job B runs its allreduce; then they swap (CrossoverScheduler,
Luo et al. 2021). Generalized to N jobs with unequal phase times:

* One order everywhere ("crossover synchronization"). When a device is free,
  it goes to the job with the smallest key `(turn, job_id)`: the job that
  is furthest behind, ties broken by its id. A job's turn is its iteration
  counter plus a base its ranks agreed on when it started. The ranks advance
  the counter in lockstep (every step ends in the job's allreduce), and base
  and id are the same on every node, so every node computes the same key for
  the same job without exchanging a message: all ranks of a job get the device
  in the same round, and a job's allreduce does not wait for a rank queued
  behind another job elsewhere. The key depends on no local history, so a
  node that joined late or lost a job is in step from its next decision on.
* Fair rotation for late starters. A job that started at iteration 0 next to
  one at iteration 500 would be "furthest behind" for 500 turns and run
  ahead of it. Instead, each rank asks its daemon for `turn_floor` (the
  smallest turn of the other jobs there) before its first request, and the
  job takes the largest answer over its ranks as its base: it joins the
  rotation where the others are, and from then on the jobs alternate. Nodes
  may answer one turn apart (a job's ranks are up to one iteration apart);
  the maximum is one agreed number, so the order stays consistent.
* Backfilling, adapted to measured phase times. If the job that should go
  next (the owner) is still in its allreduce, a ready job may use the device
  now when its expected compute time (EMA of its measured compute phases)
  fits before the owner is expected back (owner's comm start + the larger of
  `slack` × EMA of its comm phases and that EMA + `margin_s`). The owner is
  not delayed, and the device does not idle.
  This test reads the clock, so two nodes whose events are skewed by a few
  milliseconds can decide a borderline case differently; the order itself
  does not drift (the keys put every node back in step at the next decision).
* Bounded waiting. Otherwise the device is kept for the owner only until it
  is expected back, and never longer than `max_wait_s`; then the best ready
  job is served, and the late job counts as inactive (is not waited for)
  until it asks again. A newly joined job is waited for once, so jobs that
  start together start in the same order everywhere. A stalled, dead or
  departed job never holds a device.
* No starvation. A waiting rank's key does not change while it waits, and
  each grant raises the served job's key, so every waiting rank becomes the
  smallest key after finitely many grants.
* No deadlock. The policy never withholds a free device without a deadline,
  so no chain of ranks waiting on one another across nodes is permanent.

`TurnsSettings(tiebreak="join_order")` drops the synchronization: jobs at
the same turn are served in the order they joined *this node*, so nodes whose
ranks joined in different orders serve them in different sequences, and a
job's allreduce waits for its rank queued behind another job elsewhere. The
simulator runs it as `turns-nosync`, to measure what the shared order buys.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies._queues import QueuePolicy, _Device

__all__ = ["TurnsPolicy", "TurnsSettings"]


@dataclass(frozen=True)
class TurnsSettings:
    slack: float = 1.2
    # At least this much beyond the comm EMA: nodes see the same events up to a few ms
    # apart, and a deadline inside that skew would be decided differently on each node.
    margin_s: float = 0.005
    backfill: bool = True
    max_wait_s: float = 0.5
    initial_wait_s: float = 0.25  # an owner whose comm time is not measured yet (its first allreduce)
    ema_alpha: float = 0.3
    # Between jobs at the same turn: "job_id" (the same on every node) or "join_order"
    # (the order the jobs joined this node, which nodes need not share).
    tiebreak: Literal["job_id", "join_order"] = "job_id"

    def __post_init__(self) -> None:
        if self.tiebreak not in ("job_id", "join_order"):
            raise ValueError(f"tiebreak {self.tiebreak!r}: choose job_id or join_order")


@dataclass
class _Job:
    name: str
    joined: int  # its place in this node's join order (the "join_order" tie-break)
    iteration: int = -1  # latest turn one of its ranks asked the device for (-1: none yet)
    active: bool = True  # False after it missed a bounded wait, until it asks again
    comm_ema: float | None = None
    compute_ema: float | None = None
    comm_began: dict[int, float] = field(default_factory=dict)  # device -> its rank's last release


@dataclass
class _Hold:
    owner: str
    since: float
    deadline: float


class TurnsPolicy(QueuePolicy):
    """Cluster-consistent interleaving with backfilling and bounded waiting. Pure: time only through `now`."""

    name = "turns"
    blocks = True

    def __init__(self, settings: TurnsSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or TurnsSettings()
        if self.settings.tiebreak == "join_order":
            self.name = "turns-nosync"
        self._jobs: dict[str, _Job] = {}
        self._joins = itertools.count()
        self._turns: dict[RankKey, int] = {}  # each rank's latest requested turn
        self._holds: dict[int, _Hold] = {}
        self.backfills = 0
        self.timeouts = 0

    def decisions(self) -> dict[str, int]:
        return {"backfill": self.backfills, "timeout": self.timeouts}

    # ---- events -------------------------------------------------------------

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        self._q.add(rank)
        if rank.key.job_id not in self._jobs:
            self._jobs[rank.key.job_id] = _Job(rank.job_name, next(self._joins))
        return self._dispatch(rank.device, now)

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        device = self._q.remove(key)
        self._turns.pop(key, None)
        if not any(k.job_id == key.job_id for k in self._q.ranks):
            del self._jobs[key.job_id]
        return self._dispatch(device, now)

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._q.enqueue(key, now)
        self._asked(key, iteration)
        return self._dispatch(self._q.ranks[key].device, now)

    def occupy(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        granted = super().occupy(key, iteration, now)
        self._asked(key, iteration)
        self._holds.pop(self._q.ranks[key].device, None)
        return granted

    def _asked(self, key: RankKey, iteration: int) -> None:
        job = self._jobs[key.job_id]
        job.iteration = max(job.iteration, iteration)
        job.active = True
        self._turns[key] = iteration

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.release(key)
        device = self._q.ranks[key].device
        self._jobs[key.job_id].comm_began[device] = now
        return self._dispatch(device, now)

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._q.cancel(key)
        return self._dispatch(self._q.ranks[key].device, now)

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        job = self._jobs.get(key.job_id)
        if job is None or duration_s <= 0:
            return
        a = self.settings.ema_alpha
        if phase == "comm":
            job.comm_ema = duration_s if job.comm_ema is None else (1 - a) * job.comm_ema + a * duration_s
        elif phase == "compute":
            job.compute_ema = duration_s if job.compute_ema is None else (1 - a) * job.compute_ema + a * duration_s

    def tick(self, now: float) -> list[RankKey]:
        granted: list[RankKey] = []
        for device, hold in list(self._holds.items()):
            if now >= hold.deadline:
                granted += self._dispatch(device, now)
        return granted

    def next_deadline(self) -> float | None:
        """When `tick` must next be called for a bounded wait to end on time (None: no wait running)."""
        return min((h.deadline for h in self._holds.values()), default=None)

    # ---- queries ------------------------------------------------------------

    def order(self, device: int) -> list[str]:
        """Job ids on the device, in the order the policy would serve them now."""
        return sorted(self._jobs_on(device), key=lambda j: self._key(j, device))

    def turn_floor(self, device: int, job_id: str) -> int:
        turns = [self._key(j, device)[0] for j in self._jobs_on(device)
                 if j != job_id and self._jobs[j].iteration >= 0 and self._jobs[j].active]
        return min(turns, default=0)

    def _order(self, device: int) -> tuple[str, ...]:
        return tuple(self._jobs[j].name for j in self.order(device))

    # ---- decisions ----------------------------------------------------------

    def _jobs_on(self, device: int) -> set[str]:
        return {k.job_id for k, r in self._q.ranks.items() if r.device == device}

    def _key(self, job_id: str, device: int) -> tuple:
        """Serve order on the device, smallest first: the job's next turn there, then its id.

        The turn is read from the job's own ranks on this device: a waiting rank's
        requested turn, or the turn after the latest one a rank asked for. Never from
        the job's furthest rank on the node: its rank on another device may be a turn
        ahead, and this device would then rank the job a turn later than every other
        node and device does. A rank that has not asked yet will join at the job's turn.
        """
        dev = self._q.devices.get(device)
        waiting = set(dev.waiting) if dev else set()
        job = self._jobs[job_id]
        turns = []
        for key, rank in self._q.ranks.items():
            if key.job_id != job_id or rank.device != device:
                continue
            asked = self._turns.get(key)
            if asked is None:
                turns.append(max(job.iteration, 0))
            else:
                turns.append(asked if key in waiting else asked + 1)
        return (min(turns, default=job.iteration + 1), self._tiebreak(job_id))

    def _tiebreak(self, job_id: str) -> str | int:
        """Between jobs at the same turn: the job id (the same on every node) or, with
        `tiebreak="join_order"`, the job's place in this node's join order."""
        return job_id if self.settings.tiebreak == "job_id" else self._jobs[job_id].joined

    def _expected_back(self, job: _Job, device: int, now: float) -> float:
        began = job.comm_began.get(device)
        if began is None or job.comm_ema is None:
            return (began if began is not None else now) + self.settings.initial_wait_s
        return began + max(self.settings.slack * job.comm_ema, job.comm_ema + self.settings.margin_s)

    def _dispatch(self, device: int, now: float) -> list[RankKey]:
        dev = self._q.devices.get(device)
        if dev is None or dev.holders or not dev.waiting:
            self._holds.pop(device, None)
            return []
        waiting_jobs = {k.job_id for k in dev.waiting}
        active = {j for j in self._jobs_on(device) if self._jobs[j].active} | waiting_jobs
        owner = min(active, key=lambda j: self._key(j, device))
        best_ready = min(waiting_jobs, key=lambda j: self._waiting_key(dev, j))
        if owner in waiting_jobs:
            return self._grant(dev, device, owner)
        hold = self._holds.get(device)
        if hold is None or hold.owner != owner:
            back = self._expected_back(self._jobs[owner], device, now)
            hold = _Hold(owner, now, min(back, now + self.settings.max_wait_s))
            self._holds[device] = hold
        compute = self._jobs[best_ready].compute_ema
        if self.settings.backfill and compute is not None and now + compute <= hold.deadline:
            self.backfills += 1
            return self._grant(dev, device, best_ready)
        if now >= hold.deadline:
            self.timeouts += 1
            self._jobs[owner].active = False
            return self._grant(dev, device, best_ready)
        return []

    def _first_waiting(self, dev: _Device, job_id: str) -> RankKey:
        """The job's waiting rank on the device with the smallest requested turn."""
        return min((k for k in dev.waiting if k.job_id == job_id), key=lambda k: self._turns[k])

    def _waiting_key(self, dev: _Device, job_id: str) -> tuple:
        """Serve order among ready jobs: the turn of the job's first waiting rank, then the tie-break."""
        return (self._turns[self._first_waiting(dev, job_id)], self._tiebreak(job_id))

    def _grant(self, dev: _Device, device: int, job_id: str) -> list[RankKey]:
        key = self._first_waiting(dev, job_id)
        self._q.grant(dev, key)
        self._holds.pop(device, None)
        return [key]
