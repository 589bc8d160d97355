"""A discrete-event cluster simulator that drives the daemon's own policies on a simulated clock.

Planning past one machine: what does `crossover` buy on 64 nodes x 8 GPUs with
2-4 jobs per GPU, jittery phases, and jobs arriving and leaving? The simulator
answers with the same policy classes the daemon runs (`crossover.daemon.policies`),
one instance per node as one daemon per node, fed the events a real rank sends
(`join`, `request`, `observe`, `release`, `leave`) and `tick` at the policy's
deadlines. Only the world around the policies is modelled:

* A rank of job j asks for its device for iteration i+1 when j's allreduce i
  completes (iteration 0: when every rank has joined, as after Horovod's init).
  Once granted it computes for its own draw of compute time (per-rank mean,
  lognormal jitter of mean 1), reports `observe('compute')` and `release`s.
* The allreduce of iteration i starts when every rank of the job has finished
  its compute, and needs `comm_s` (jittered) of link time. Each (node, device)
  has its own link (one NIC per GPU, as in the emulated cluster where each node
  has one device and one link); allreduces crossing a link at the same time
  share it, so a job's allreduce runs at 1/k of full speed where k is the
  largest number of allreduces on any of its links (`shared_links=False`: a
  fixed delay). `link_sharing="fifo"` instead serves a link's allreduces in the
  order they began (the earliest runs at full speed, the others wait).
  Unscheduled co-located jobs stay in lockstep under `fair` (neutrally
  stable) and fall into alternation under `fifo`; the emulated cluster's
  links behave in between (why is not established), so the two bracket what
  an unscheduled cluster does. Each rank then reports `observe('comm')` for
  its comm phase (from its release to the allreduce's end).
* Ranks computing on one device at once (what `passthrough` allows) share it
  by processor sharing: each of k progresses at 1/(k * (1 + switch_penalty)).
* Ticks: with `tick_s`, on a fixed cadence per node like the daemon's reaper
  (`reap_interval_s`, 0.1 s); otherwise exactly at the policy's `next_deadline()`.
  Only while some device has waiting ranks and no holder: the only state in
  which a tick can change anything.

`crossover-nosync` (`LocalOrderCrossoverPolicy`) is `crossover` without
crossover synchronization: identical keys, backfilling and bounded waits, but
ties are broken by the order jobs joined *that node*, so nodes may disagree.

Everything is seeded: the same inputs give the same result, event for event.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from crossover.daemon.api import CrossoverError, Policy, RankKey, RankRef
from crossover.daemon.policies import CrossoverPolicy, CrossoverSettings, ExclusivePolicy, PassthroughPolicy

__all__ = [
    "JobSpec",
    "SimConfig",
    "JobResult",
    "SimResult",
    "ComputeSpan",
    "SimulationError",
    "LINK_SHARING",
    "LocalOrderCrossoverPolicy",
    "POLICIES",
    "SMALL_POLICIES",
    "simulate",
    "simulate_small",
    "alone_iteration_s",
]


LINK_SHARING = ("fair", "fifo")


class SimulationError(CrossoverError):
    """The simulated world and a policy disagree (e.g. a grant for a rank that is not waiting)."""


# ---- the policy variant without crossover synchronization ------------------------------------


class LocalOrderCrossoverPolicy(CrossoverPolicy):
    """`crossover` minus synchronization: ties are broken by each node's local join order.

    Keys, backfilling and bounded waiting are `CrossoverPolicy`'s own; only the
    tie-break differs. Where the same jobs joined two nodes in different orders
    (their ranks started at slightly different times), jobs at the same
    iteration are served in different sequences on the two nodes, and a job's
    allreduce waits for its rank that is queued behind another job elsewhere.
    """

    name = "crossover-nosync"

    def __init__(self, settings: CrossoverSettings | None = None) -> None:
        super().__init__(settings)
        self._join_seq: dict[str, int] = {}
        self._next_seq = itertools.count()

    def join(self, rank: RankRef, now: float) -> list[RankKey]:
        if rank.key.job_id not in self._join_seq:
            self._join_seq[rank.key.job_id] = next(self._next_seq)
        return super().join(rank, now)

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        granted = super().leave(key, now)
        if not any(k.job_id == key.job_id for k in self._q.ranks):
            self._join_seq.pop(key.job_id, None)
        return granted

    def _tiebreak(self, job_id: str) -> str | int:
        return self._join_seq[job_id]


PolicyFactory = Callable[[], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "passthrough": PassthroughPolicy,
    "exclusive": ExclusivePolicy,
    "crossover-nosync": LocalOrderCrossoverPolicy,
    "crossover": CrossoverPolicy,
}
"""Policies the simulator compares, by name; `simulate` also takes any factory."""

SMALL_POLICIES = ("alone", "sequential", *POLICIES)
"""What `simulate_small` accepts: the emulated-cluster benchmark's variants."""


# ---- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """One job: where its ranks run, how long its phases take, when it comes and goes.

    `placement[r]` is rank r's (node, device). `compute_s` is the mean compute
    phase, one value for all ranks or one per rank (heterogeneous workers).
    The job leaves after `iterations` iterations, at `leave_s` (a crash or a
    kill), or when the simulation ends, whichever is first.
    """

    name: str
    placement: tuple[tuple[int, int], ...]
    compute_s: float | tuple[float, ...]
    comm_s: float
    iterations: int | None = None
    arrival_s: float = 0.0
    leave_s: float | None = None
    jitter: float = 0.0  # sigma of the lognormal factor (mean 1) on each compute and allreduce

    def rank_compute_s(self, rank: int) -> float:
        return self.compute_s if isinstance(self.compute_s, (int, float)) else self.compute_s[rank]

    def validate(self, n_nodes: int, devices_per_node: int) -> None:
        if not self.placement:
            raise ValueError(f"job {self.name!r} has no ranks")
        for node, dev in self.placement:
            if not (0 <= node < n_nodes and 0 <= dev < devices_per_node):
                raise ValueError(f"job {self.name!r} places a rank on ({node}, {dev}), outside "
                                 f"{n_nodes} nodes x {devices_per_node} devices")
        if not isinstance(self.compute_s, (int, float)) and len(self.compute_s) != len(self.placement):
            raise ValueError(f"job {self.name!r}: {len(self.compute_s)} compute times for "
                             f"{len(self.placement)} ranks")
        if min(self.rank_compute_s(r) for r in range(len(self.placement))) <= 0 or self.comm_s < 0:
            raise ValueError(f"job {self.name!r}: compute times must be > 0 and comm_s >= 0")
        if self.iterations is not None and self.iterations < 1:
            raise ValueError(f"job {self.name!r}: iterations must be >= 1")


@dataclass(frozen=True)
class SimConfig:
    """The world around the policies. Defaults: an ideal world (no penalty, exact deadlines)."""

    seed: int = 0
    switch_penalty: float = 0.0  # k>1 concurrent computes each run at 1/(k*(1+penalty))
    shared_links: bool = True  # concurrent allreduces through one (node, device) link share it
    link_sharing: str = "fair"  # how they share it: "fair" (equal rates) or "fifo" (in the order they began)
    tick_s: float | None = None  # None: tick at the policy's deadlines; else every tick_s (daemon reaper)
    startup_spread_s: float = 0.0  # ranks of a job join within this window after its arrival
    grant_latency_s: float = 0.0  # grant round trip, added to each blocking compute phase
    interference: float = 0.0  # a compute phase and an allreduce on one (node, device) each run at 1/(1+this)
    horizon_s: float | None = None  # stop here (jobs still running count what they did)
    warmup_iterations: int = 3  # excluded from per-job rates
    record_trace: bool = False  # keep every compute span (node, device, job, start, end)
    check_exclusive: bool = True  # fail if a blocking policy lets two ranks compute on one device


# ---- outputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeSpan:
    node: int
    device: int
    job: str
    rank: int
    iteration: int
    start: float
    end: float


@dataclass
class JobResult:
    name: str
    job_id: str
    ranks: int
    iterations: int
    iter_per_s: float | None  # over the job's own iterations after warm-up
    alone_iter_s: float  # one iteration with the devices and links to itself
    slowdown: float | None  # (1 / iter_per_s) / alone_iter_s
    bound_iter_per_s: float | None  # 1 / max(C + M, max over its devices of max(sum C, sum M)); static only
    grant_wait_mean_s: float
    grant_wait_max_s: float
    finished: bool
    left_at: float | None


@dataclass
class SimResult:
    policy: str
    jobs: list[JobResult]
    makespan_s: float
    throughput_iter_s: float  # sum over jobs of iter_per_s
    normalized_throughput: float  # sum over jobs of alone_iter_s * iter_per_s ("jobs at full speed")
    bound_iter_s: float | None  # sum of the jobs' bounds (static scenarios only)
    bound_fraction: float | None
    device_busy: float  # mean over devices of time with >= 1 compute / time with >= 1 rank present
    idle_waiting: float  # same, of time the device idled while ranks waited for it (held for a turn)
    fairness: float | None  # max / min over jobs of normalized progress (1 = perfectly fair)
    slowdown_mean: float | None
    slowdown_max: float | None
    completed_iterations: int
    stalled_jobs: list[str]  # jobs still waiting when nothing else could happen (a deadlock)
    events: int
    policy_calls: int
    trace: list[ComputeSpan] = field(default_factory=list)

    def to_dict(self, per_job: bool = True) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("jobs", "trace")}
        if per_job:
            d["jobs"] = [j.__dict__.copy() for j in self.jobs]
        return d


# ---- the simulated world ------------------------------------------------------------------------

_JOINING, _IDLE, _WAITING, _COMPUTE, _COMM, _GONE = range(6)
_ARRIVE, _JOIN, _LEAVE, _COMPUTE_DONE, _COMM_DONE, _TICK = range(6)


class _Rank:
    __slots__ = ("key", "ref", "job", "node", "device", "mean_c", "state", "work", "rate", "since",
                 "version", "granted_at", "requested_at", "comm_began", "iteration")

    def __init__(self, key: RankKey, ref: RankRef, job: _Job, node: int, mean_c: float) -> None:
        self.key, self.ref, self.job, self.node, self.device, self.mean_c = key, ref, job, node, ref.device, mean_c
        self.state = _JOINING
        self.work = self.rate = self.since = 0.0
        self.version = 0
        self.granted_at = self.requested_at = self.comm_began = 0.0
        self.iteration = 0


class _Job:
    __slots__ = ("spec", "id", "ranks", "joined", "pending", "iteration", "links", "comm_work", "comm_rate",
                 "comm_since", "comm_version", "in_comm", "iter_ends", "started_at", "left_at", "active",
                 "finished", "waits", "turn_base")

    def __init__(self, spec: JobSpec, job_id: str) -> None:
        self.spec, self.id = spec, job_id
        self.turn_base = 0
        self.ranks: list[_Rank] = []
        self.joined = self.pending = self.iteration = 0
        self.links: tuple[tuple[int, int], ...] = tuple(dict.fromkeys(spec.placement))
        self.comm_work = self.comm_rate = self.comm_since = 0.0
        self.comm_version = 0
        self.in_comm = False
        self.iter_ends: list[float] = []
        self.started_at: float | None = None
        self.left_at: float | None = None
        self.active = True
        self.finished = False
        self.waits: list[float] = []


class _Device:
    __slots__ = ("node", "link", "computing", "waiting", "hungry", "hungry_since", "hungry_total", "present",
                 "present_since", "present_total", "busy_since", "busy_total")

    def __init__(self, node: _Node, link: tuple[int, int]) -> None:
        self.node = node
        self.link = link  # the (node, device) link its ranks' allreduces cross
        self.computing: list[_Rank] = []
        self.waiting = 0
        self.hungry = False  # ranks wait and none computes: the only state in which a tick can matter
        self.hungry_since = self.hungry_total = 0.0
        self.present = 0
        self.present_since = self.present_total = self.busy_since = self.busy_total = 0.0


class _Node:
    __slots__ = ("policy", "devices", "tick_at", "phase", "deadline", "hungry")

    def __init__(self, index: int, policy: Policy, n_devices: int, phase: float,
                 deadline: Callable[[], Optional[float]] | None) -> None:
        self.policy = policy
        self.devices = [_Device(self, (index, d)) for d in range(n_devices)]
        self.hungry = 0  # devices with ranks waiting and none computing
        self.tick_at: float | None = None
        self.phase = phase
        self.deadline = deadline




class _World:
    def __init__(self, jobs: Sequence[JobSpec], factory: PolicyFactory, n_nodes: int, devices_per_node: int,
                 cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.calls = 0
        self.trace: list[ComputeSpan] = []
        self.nodes: list[_Node] = []
        for index in range(n_nodes):
            p = factory()
            self.nodes.append(_Node(index, p, devices_per_node, self.rng.random() * (cfg.tick_s or 0.0),
                                    None if cfg.tick_s else p.next_deadline))
        self.blocks = bool(self.nodes[0].policy.blocks) if self.nodes else True
        self.policy_name = str(getattr(self.nodes[0].policy, "name", "?")) if self.nodes else "?"
        self.links: dict[tuple[int, int], list[_Job]] = {}
        self.by_key: dict[RankKey, _Rank] = {}
        self.jobs: list[_Job] = []
        self.stalled: list[str] = []
        names: set[str] = set()
        for spec in jobs:
            spec.validate(n_nodes, devices_per_node)
            if spec.name in names:
                raise ValueError(f"job name {spec.name!r} is used twice")
            names.add(spec.name)
            # Job ids are random-looking, as the plugin's (rank 0 draws one and broadcasts
            # it), so that the cluster-wide order is unrelated to arrival or name.
            job_id = hashlib.sha1(f"{cfg.seed}/{spec.name}".encode()).hexdigest()[:16]
            job = _Job(spec, job_id)
            for r, (node, dev) in enumerate(spec.placement):
                key = RankKey(job_id, r)
                ref = RankRef(key, spec.name, dev, len(spec.placement), spec.arrival_s)
                rank = _Rank(key, ref, job, node, spec.rank_compute_s(r))
                job.ranks.append(rank)
                self.by_key[key] = rank
            self.jobs.append(job)
            self.push(spec.arrival_s, _ARRIVE, job)
            if spec.leave_s is not None:
                self.push(spec.leave_s, _LEAVE, job)

    # ---- plumbing ----

    def push(self, t: float, kind: int, obj: Any, version: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj, version))

    def jitter(self, sigma: float) -> float:
        return self.rng.lognormvariate(-0.5 * sigma * sigma, sigma) if sigma > 0 else 1.0

    def run(self) -> None:
        horizon = self.cfg.horizon_s
        handlers: dict[int, Callable[[Any, int], None]] = {
            _ARRIVE: self.on_arrive, _JOIN: self.on_join, _LEAVE: self.on_leave,
            _COMPUTE_DONE: self.on_compute_done, _COMM_DONE: self.on_comm_done, _TICK: self.on_tick}
        heap = self.heap
        while heap:
            t, _, kind, obj, version = heapq.heappop(heap)
            if horizon is not None and t > horizon:
                self.now = horizon
                break
            self.now = t
            self.events += 1
            handlers[kind](obj, version)
        else:
            # Nothing left to happen, yet these jobs neither finished nor were told to leave.
            self.stalled = [j.spec.name for j in self.jobs if j.active]
        for job in self.jobs:
            if job.active:
                self.leave_job(job, finished=False, record_only=True)

    # ---- job life ----

    def on_arrive(self, job: _Job, _v: int) -> None:
        spread = self.cfg.startup_spread_s
        for rank in job.ranks:
            self.push(self.now + (self.rng.random() * spread if spread > 0 else 0.0), _JOIN, rank)

    def on_join(self, rank: _Rank, _v: int) -> None:
        job = rank.job
        if not job.active:
            return
        node = self.nodes[rank.node]
        dev = node.devices[rank.device]
        self.present(dev, +1)
        rank.state = _IDLE
        self.call(node, node.policy.join(rank.ref, self.now))
        job.joined += 1
        if job.joined == len(job.ranks):  # Horovod's init is a barrier: iteration 0 starts together
            job.started_at = self.now
            job.pending = len(job.ranks)
            # what the plugin does before the first request: the largest floor over the job's ranks
            job.turn_base = max(self.nodes[r.node].policy.turn_floor(r.device, job.id) for r in job.ranks)
            for r in job.ranks:
                self.request(r)

    def on_leave(self, job: _Job, _v: int) -> None:
        if job.active:
            self.leave_job(job, finished=False)

    def leave_job(self, job: _Job, finished: bool, record_only: bool = False) -> None:
        job.active = False
        job.finished = finished
        job.left_at = self.now
        if job.in_comm:
            self.comm_stop(job)
        for rank in job.ranks:
            if rank.state == _JOINING:
                rank.state = _GONE
                continue
            node = self.nodes[rank.node]
            dev = node.devices[rank.device]
            if rank.state == _COMPUTE:
                self.compute_stop(dev, rank)
            elif rank.state == _WAITING:
                dev.waiting -= 1
                self.mark(dev)
            rank.state = _GONE
            self.present(dev, -1)
            if not record_only:
                self.call(node, node.policy.leave(rank.key, self.now))

    def present(self, dev: _Device, delta: int) -> None:
        if dev.present == 0 and delta > 0:
            dev.present_since = self.now
        dev.present += delta
        if dev.present == 0:
            dev.present_total += self.now - dev.present_since

    # ---- policy calls ----

    def call(self, node: _Node, granted: list[RankKey]) -> None:
        """Deliver a policy call's grants, then make sure the node is ticked when it needs to be."""
        self.calls += 1
        for key in granted:
            rank = self.by_key.get(key)
            if rank is None or rank.state != _WAITING or self.nodes[rank.node] is not node:
                raise SimulationError(f"{self.policy_name} granted {key} at t={self.now:.6f}, "
                                      "which is not a rank waiting on this node")
            dev = node.devices[rank.device]
            dev.waiting -= 1
            rank.job.waits.append(self.now - rank.requested_at)
            self.compute_start(dev, rank)
            self.mark(dev)
        self.arm_tick(node)

    def request(self, rank: _Rank) -> None:
        node = self.nodes[rank.node]
        rank.state = _WAITING
        rank.requested_at = self.now
        dev = node.devices[rank.device]
        dev.waiting += 1
        self.mark(dev)
        self.call(node, node.policy.request(rank.key, rank.job.turn_base + rank.iteration, self.now))

    def mark(self, dev: _Device) -> None:
        hungry = dev.waiting > 0 and not dev.computing
        if hungry != dev.hungry:
            dev.hungry = hungry
            if hungry:
                dev.node.hungry += 1
                dev.hungry_since = self.now
            else:
                dev.node.hungry -= 1
                dev.hungry_total += self.now - dev.hungry_since

    def arm_tick(self, node: _Node) -> None:
        if not node.hungry:
            return  # a tick only matters to a device whose waiting ranks nobody serves
        now = self.now
        if node.deadline is not None:
            t = node.deadline()
            if t is None or t <= now:
                return
        else:
            period = self.cfg.tick_s
            assert period, "a node reads its policy's deadlines unless ticks are periodic"
            t = node.phase + (math.floor((now - node.phase) / period) + 1) * period
            if t <= now:  # `now` sits on the grid up to rounding
                t += period
        if node.tick_at is None or node.tick_at <= now or t < node.tick_at:
            node.tick_at = t
            self.push(t, _TICK, node)

    def on_tick(self, node: _Node, _v: int) -> None:
        if node.tick_at != self.now:
            return  # superseded by an earlier deadline
        node.tick_at = None
        if not node.hungry:
            return  # the wait it was armed for has ended
        if node.deadline is not None:
            t = node.deadline()
            if t is not None and t > self.now:  # that wait ended, and a later one began
                self.arm_tick(node)
                return
        self.call(node, node.policy.tick(self.now))

    # ---- compute: processor sharing per device ----

    def compute_start(self, dev: _Device, rank: _Rank) -> None:
        rank.state = _COMPUTE
        rank.granted_at = self.now
        rank.work = rank.mean_c * self.jitter(rank.job.spec.jitter)
        if self.blocks:
            rank.work += self.cfg.grant_latency_s
        rank.since = self.now
        rank.rate = 0.0  # forces a completion event in `reshare`
        if not dev.computing:
            dev.busy_since = self.now
        dev.computing.append(rank)
        if self.cfg.check_exclusive and self.blocks and len(dev.computing) > 1:
            raise SimulationError(f"{self.policy_name} let {len(dev.computing)} ranks compute on node "
                                  f"{rank.node} device {rank.device} at t={self.now:.6f}")
        self.reshare(dev)
        if self.cfg.interference and len(dev.computing) == 1:  # the link's allreduces now share the device
            self.rerate(self.links.get(dev.link, ()))

    def compute_stop(self, dev: _Device, rank: _Rank) -> None:
        dev.computing.remove(rank)
        rank.version += 1
        if not dev.computing:
            dev.busy_total += self.now - dev.busy_since
        if self.cfg.record_trace:
            self.trace.append(ComputeSpan(rank.node, rank.device, rank.job.spec.name, rank.key.rank,
                                          rank.iteration, rank.granted_at, self.now))
        self.mark(dev)
        self.reshare(dev)
        if self.cfg.interference and not dev.computing:
            self.rerate(self.links.get(dev.link, ()))

    def reshare(self, dev: _Device) -> None:
        k = len(dev.computing)
        if k == 0:
            return
        rate = 1.0 if k == 1 else 1.0 / (k * (1.0 + self.cfg.switch_penalty))
        if self.cfg.interference and any(job.comm_rate > 0 for job in self.links.get(dev.link, ())):
            rate /= 1.0 + self.cfg.interference
        now = self.now
        for r in dev.computing:
            r.work = max(0.0, r.work - (now - r.since) * r.rate)
            r.since = now
            if r.rate != rate:
                r.rate = rate
                r.version += 1
                self.push(now + r.work / rate, _COMPUTE_DONE, r, r.version)

    def on_compute_done(self, rank: _Rank, version: int) -> None:
        if version != rank.version or rank.state != _COMPUTE:
            return
        node = self.nodes[rank.node]
        self.compute_stop(node.devices[rank.device], rank)
        rank.state = _COMM
        rank.comm_began = self.now
        node.policy.observe(rank.key, "compute", self.now - rank.granted_at, self.now)
        self.call(node, node.policy.release(rank.key, self.now))
        job = rank.job
        job.pending -= 1
        if job.pending == 0 and job.active:
            self.comm_start(job)

    # ---- allreduce: link sharing ----

    def comm_start(self, job: _Job) -> None:
        job.in_comm = True
        job.comm_work = job.spec.comm_s * self.jitter(job.spec.jitter)
        job.comm_since = self.now
        job.comm_rate = -1.0  # forces a rate (and, if it may run, a completion event) in `rerate`
        affected: dict[_Job, None] = {job: None}
        for link in job.links:
            sharing = self.links.setdefault(link, [])
            sharing.append(job)
            if self.cfg.shared_links and len(sharing) > 1:
                affected.update(dict.fromkeys(sharing))
        self.rerate(affected)
        self._reshare_links(affected)

    def comm_stop(self, job: _Job) -> None:
        job.in_comm = False
        job.comm_version += 1
        affected: dict[_Job, None] = {}
        for link in job.links:
            sharing = self.links[link]
            sharing.remove(job)
            if self.cfg.shared_links and sharing:
                affected.update(dict.fromkeys(sharing))
        self.rerate(affected)
        self._reshare_links({job: None, **affected})

    def _device(self, link: tuple[int, int]) -> _Device:
        return self.nodes[link[0]].devices[link[1]]

    def _reshare_links(self, jobs: Any) -> None:
        """Compute on the devices these jobs' allreduces cross runs slower or faster now (interference)."""
        if self.cfg.interference:
            for link in dict.fromkeys(link for job in jobs for link in job.links):
                self.reshare(self._device(link))

    def rerate(self, jobs: Any) -> None:
        now = self.now
        for job in jobs:
            if not self.cfg.shared_links:
                rate = 1.0
            elif self.cfg.link_sharing == "fifo":
                # Lists are in arrival order on every link, so the earliest of any set of
                # sharing jobs is first on all its links: someone always runs, no deadlock.
                rate = 1.0 if all(self.links[link][0] is job for link in job.links) else 0.0
            else:
                rate = 1.0 / max(map(len, map(self.links.__getitem__, job.links)))
            if rate > 0 and self.cfg.interference and any(self._device(link).computing for link in job.links):
                rate /= 1.0 + self.cfg.interference
            if rate != job.comm_rate:
                job.comm_work = max(0.0, job.comm_work - (now - job.comm_since) * job.comm_rate)
                job.comm_since = now
                job.comm_rate = rate
                job.comm_version += 1
                if rate > 0:
                    self.push(now + job.comm_work / rate, _COMM_DONE, job, job.comm_version)

    def on_comm_done(self, job: _Job, version: int) -> None:
        if version != job.comm_version or not job.in_comm:
            return
        self.comm_stop(job)
        job.iter_ends.append(self.now)
        job.iteration += 1
        now = self.now
        for rank in job.ranks:
            node = self.nodes[rank.node]
            node.policy.observe(rank.key, "comm", now - rank.comm_began, now)
            rank.state = _IDLE
            rank.iteration = job.iteration
        if job.spec.iterations is not None and job.iteration >= job.spec.iterations:
            self.leave_job(job, finished=True)
            return
        job.pending = len(job.ranks)
        for rank in job.ranks:
            self.request(rank)


# ---- metrics ------------------------------------------------------------------------------------


def alone_iteration_s(spec: JobSpec, seed: int = 0, samples: int = 2000) -> float:
    """Mean iteration time of the job with every device and link to itself.

    An iteration is its slowest rank's compute plus the allreduce; with jitter or
    heterogeneous ranks that is more than mean(C) + M, so it is estimated by
    sampling (exact when there is no jitter).
    """
    means = np.array([spec.rank_compute_s(r) for r in range(len(spec.placement))])
    if spec.jitter <= 0:
        return float(means.max()) + spec.comm_s
    s = spec.jitter
    draws = np.random.default_rng(seed).lognormal(-0.5 * s * s, s, size=(samples, len(means)))
    return float((draws * means).max(axis=1).mean()) + spec.comm_s


def _static(jobs: Sequence[JobSpec]) -> bool:
    return all(j.arrival_s == 0 and j.leave_s is None for j in jobs) and len({j.iterations for j in jobs}) == 1


def _bounds(jobs: Sequence[JobSpec], shared_links: bool) -> list[float]:
    """Per job: 1 / max(C + M, over its devices max(sum of compute means, sum of comm times)).

    For identical jobs this is the pipeline bound 1/max(sum C, sum M): a device
    (and its link) serves every job on it once per cycle at best. Means only,
    no jitter. For jobs that differ it is the bound of round-robin service (one
    iteration per job per cycle), which a policy favouring short jobs can beat.
    """
    c_sum: dict[tuple[int, int], float] = {}
    m_sum: dict[tuple[int, int], float] = {}
    for spec in jobs:
        for r, place in enumerate(spec.placement):
            c_sum[place] = c_sum.get(place, 0.0) + spec.rank_compute_s(r)
        for place in set(spec.placement):
            m_sum[place] = m_sum.get(place, 0.0) + spec.comm_s
    out = []
    for spec in jobs:
        cycle = max(max(c_sum[p], m_sum[p] if shared_links else 0.0) for p in spec.placement)
        alone = max(spec.rank_compute_s(r) for r in range(len(spec.placement))) + spec.comm_s
        out.append(1.0 / max(alone, cycle))
    return out


def _results(world: _World) -> SimResult:
    cfg = world.cfg
    specs = [j.spec for j in world.jobs]
    alone = [alone_iteration_s(s, cfg.seed) for s in specs]
    static = _static(specs)
    bounds = _bounds(specs, cfg.shared_links) if static else [None] * len(specs)
    w = cfg.warmup_iterations
    out: list[JobResult] = []
    for job, a, b in zip(world.jobs, alone, bounds):
        ends = job.iter_ends
        rate = None
        if len(ends) > w + 1 or (w == 0 and ends and job.started_at is not None):
            t0 = ends[w - 1] if w > 0 else job.started_at
            assert t0 is not None
            span = ends[-1] - t0
            rate = (len(ends) - w) / span if span > 0 else None
        waits = job.waits
        out.append(JobResult(
            name=job.spec.name, job_id=job.id, ranks=len(job.ranks), iterations=len(ends), iter_per_s=rate,
            alone_iter_s=a, slowdown=(1.0 / rate) / a if rate else None, bound_iter_per_s=b,
            grant_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
            grant_wait_max_s=max(waits, default=0.0), finished=job.finished, left_at=job.left_at))
    rated = [j for j in out if j.iter_per_s]
    throughput = sum(j.iter_per_s or 0.0 for j in rated)
    progress = [j.alone_iter_s * (j.iter_per_s or 0.0) for j in rated]
    slowdowns = [j.slowdown for j in rated if j.slowdown]
    bound = sum(b for b in bounds if b is not None) if static and rated else None
    busy, idle = [], []
    for node in world.nodes:
        for dev in node.devices:
            if dev.computing:
                dev.busy_total += world.now - dev.busy_since
                dev.busy_since = world.now
            if dev.hungry:
                dev.hungry_total += world.now - dev.hungry_since
                dev.hungry_since = world.now
            if dev.present:
                dev.present_total += world.now - dev.present_since
                dev.present_since = world.now
            if dev.present_total > 0:
                busy.append(dev.busy_total / dev.present_total)
                idle.append(dev.hungry_total / dev.present_total)
    return SimResult(
        policy=world.policy_name, jobs=out, makespan_s=world.now, throughput_iter_s=throughput,
        normalized_throughput=sum(progress), bound_iter_s=bound,
        bound_fraction=throughput / bound if bound else None,
        device_busy=sum(busy) / len(busy) if busy else 0.0, idle_waiting=sum(idle) / len(idle) if idle else 0.0,
        fairness=max(progress) / min(progress) if progress and min(progress) > 0 else None,
        slowdown_mean=sum(slowdowns) / len(slowdowns) if slowdowns else None,
        slowdown_max=max(slowdowns, default=None), completed_iterations=sum(j.iterations for j in out),
        stalled_jobs=world.stalled, events=world.events, policy_calls=world.calls, trace=world.trace)


# ---- entry points ---------------------------------------------------------------------------------


def simulate(jobs: Sequence[JobSpec], policy: Union[str, PolicyFactory], *, n_nodes: int, devices_per_node: int = 1,
             config: SimConfig | None = None) -> SimResult:
    """Run `jobs` on `n_nodes` x `devices_per_node` under `policy` (a name in `POLICIES` or a factory).

    Each node gets its own policy instance. Runs until every job has left (or
    `config.horizon_s`); a job without `iterations` or `leave_s` needs a horizon.
    """
    cfg = config or SimConfig()
    if cfg.link_sharing not in LINK_SHARING:
        raise ValueError(f"unknown link_sharing {cfg.link_sharing!r}; choose one of: {', '.join(LINK_SHARING)}")
    if isinstance(policy, str):
        try:
            factory = POLICIES[policy]
        except KeyError:
            raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}") from None
    else:
        factory = policy
    if cfg.horizon_s is None and any(j.iterations is None and j.leave_s is None for j in jobs):
        raise ValueError("a job without iterations or leave_s runs forever: set SimConfig.horizon_s")
    world = _World(jobs, factory, n_nodes, devices_per_node, cfg)
    world.run()
    return _results(world)


def simulate_small(compute_s: float, comm_s: float, n_jobs: int, policy: str, *, n_nodes: int = 2,
                   iterations: int = 200, jitter: float = 0.05, switch_penalty: float = 0.05,
                   tick_s: float | None = 0.1, startup_spread_s: float = 0.5, grant_latency_s: float = 0.0003,
                   seed: int = 0, link_sharing: str = "fair", interference: float = 0.0) -> dict[str, Any]:
    """The emulated-cluster scenario: `n_nodes` x 1 device, `n_jobs` identical jobs with one rank per node.

    `policy` is one of `SMALL_POLICIES`: a name in `POLICIES` (jobs co-located),
    `alone` (one job by itself) or `sequential` (the jobs one after another).
    Defaults mirror the testbed: the daemon ticks every 0.1 s (its reaper), a
    grant round trip costs ~0.3 ms, co-located processes on one core lose ~5%
    to switching. Returns plain numbers, to compare with the measured table:
    `throughput_iter_s` (all jobs), `per_job_iter_s`, `slowdown`, `bound_iter_s`,
    `bound_fraction`, `device_busy`, `fairness`.
    """
    if policy not in SMALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(SMALL_POLICIES)}")
    cfg = SimConfig(seed=seed, switch_penalty=switch_penalty, tick_s=tick_s, startup_spread_s=startup_spread_s,
                    grant_latency_s=grant_latency_s, link_sharing=link_sharing, interference=interference)
    place = tuple((n, 0) for n in range(n_nodes))
    specs = [JobSpec(f"job{i}", place, compute_s, comm_s, iterations=iterations, jitter=jitter) for i in range(n_jobs)]
    bound = 1.0 / max(n_jobs * compute_s, n_jobs * comm_s, compute_s + comm_s)
    if policy in ("alone", "sequential"):
        res = simulate(specs[:1], "exclusive", n_nodes=n_nodes, config=cfg)
        rate = res.jobs[0].iter_per_s or 0.0
        # Sequential: at any time one job runs at its alone speed, so the cluster does
        # `rate` iterations/s in all and each job's completion is n_jobs times later.
        per_job = [rate] if policy == "alone" else [rate / n_jobs] * n_jobs
        throughput = rate
        busy = res.device_busy
    else:
        res = simulate(specs, policy, n_nodes=n_nodes, config=cfg)
        per_job = [j.iter_per_s or 0.0 for j in res.jobs]
        throughput = res.throughput_iter_s
        busy = res.device_busy
    alone = res.jobs[0].alone_iter_s
    slowdown = [1.0 / (r * alone) if r else math.inf for r in per_job]
    return {
        "policy": policy, "n_jobs": n_jobs, "n_nodes": n_nodes, "compute_s": compute_s, "comm_s": comm_s,
        "throughput_iter_s": throughput, "per_job_iter_s": per_job, "slowdown": slowdown,
        "bound_iter_s": n_jobs * bound, "bound_fraction": throughput / (n_jobs * bound),
        "device_busy": busy, "fairness": max(per_job) / min(per_job) if min(per_job) > 0 else math.inf,
        "alone_iter_s": alone,
    }
