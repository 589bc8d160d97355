"""The event loop: ranks join, request, compute, allreduce and leave; each node's policy decides the grants.

The model it implements is described in the package's docstring (`testbed.simulator`).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any, Callable

from crossover.daemon.api import RankKey, RankRef
from crossover.daemon.policies.classes import JobClass, Priority
from testbed.device_model.model import compute_rate

from .spec import JobSpec, PolicyFactory, SimConfig, SimulationError
from .state import (
    COMM,
    COMPUTE,
    GONE,
    IDLE,
    JOINING,
    WAITING,
    ComputeSpan,
    DeviceState,
    JobState,
    NodeState,
    RankState,
)

_ARRIVE, _JOIN, _LEAVE, _COMPUTE_DONE, _COMM_DONE, _TICK, _REQUEST, _YIELD = range(8)  # event kinds


class World:
    """One run: every node's policy instance, the jobs' ranks, and a heap of timed events."""

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
        self.nodes: list[NodeState] = []
        for index in range(n_nodes):
            p = factory()
            self.nodes.append(NodeState(index, p, devices_per_node, self.rng.random() * (cfg.tick_s or 0.0),
                                    None if cfg.tick_s else p.next_deadline))
        self.blocks = bool(self.nodes[0].policy.blocks) if self.nodes else True
        self._comm_slows = cfg.interference if cfg.comm_interference is None else cfg.comm_interference
        self.policy_name = str(getattr(self.nodes[0].policy, "name", "?")) if self.nodes else "?"
        self.links: dict[tuple[int, int], list[JobState]] = {}
        self.by_key: dict[RankKey, RankState] = {}
        self.jobs: list[JobState] = []
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
            job = JobState(spec, job_id)
            for r, (node, dev) in enumerate(spec.placement):
                key = RankKey(job_id, r)
                ref = RankRef(key, spec.name, dev, len(spec.placement), spec.arrival_s)
                rank = RankState(key, ref, job, node, spec.rank_compute_s(r))
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
            _COMPUTE_DONE: self.on_compute_done, _COMM_DONE: self.on_comm_done, _TICK: self.on_tick,
            _REQUEST: self.on_skewed_request, _YIELD: self.on_yield}
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

    def on_arrive(self, job: JobState, _v: int) -> None:
        spread = self.cfg.startup_spread_s
        for rank in job.ranks:
            self.push(self.now + (self.rng.random() * spread if spread > 0 else 0.0), _JOIN, rank)

    def on_join(self, rank: RankState, _v: int) -> None:
        job = rank.job
        if not job.active:
            return
        node = self.nodes[rank.node]
        dev = node.devices[rank.device]
        self.present(dev, +1)
        rank.state = IDLE
        self.call(node, node.policy.join(rank.ref, self.now))
        cls = JobClass(Priority.parse(job.spec.priority), job.spec.weight)
        if cls != JobClass():  # the class rules (a yield asked of a rank: `SimConfig.yield_s`)
            self.call(node, node.policy.classify(rank.ref.key.job_id, cls, self.now))
        job.joined += 1
        if job.joined == len(job.ranks):  # Horovod's init is a barrier: iteration 0 starts together
            job.started_at = self.now
            job.pending = len(job.ranks)
            # what the retired `turns` needed before the first request: the largest floor over the job's ranks
            floors = [getattr(self.nodes[r.node].policy, "turn_floor", None) for r in job.ranks]
            job.turn_base = max((f(r.device, job.id) for f, r in zip(floors, job.ranks) if f), default=0)
            for r in job.ranks:
                self.request(r)

    def on_leave(self, job: JobState, _v: int) -> None:
        if job.active:
            self.leave_job(job, finished=False)

    def leave_job(self, job: JobState, finished: bool, record_only: bool = False) -> None:
        job.active = False
        job.finished = finished
        job.left_at = self.now
        if job.in_comm:
            self.comm_stop(job)
        for rank in job.ranks:
            if rank.state == JOINING:
                rank.state = GONE
                continue
            node = self.nodes[rank.node]
            dev = node.devices[rank.device]
            if rank.state == COMPUTE:
                self.compute_stop(dev, rank)
            elif rank.state == WAITING:
                dev.waiting -= 1
                self.mark(dev)
            rank.state = GONE
            self.present(dev, -1)
            if not record_only:
                self.call(node, node.policy.leave(rank.key, self.now))

    def present(self, dev: DeviceState, delta: int) -> None:
        if dev.present == 0 and delta > 0:
            dev.present_since = self.now
        dev.present += delta
        if dev.present == 0:
            dev.present_total += self.now - dev.present_since

    # ---- policy calls ----

    def call(self, node: NodeState, granted: list[RankKey]) -> None:
        """Deliver a policy call's grants, then make sure the node is ticked when it needs to be."""
        self.calls += 1
        for key in granted:
            rank = self.by_key.get(key)
            if rank is None or rank.state != WAITING or self.nodes[rank.node] is not node:
                raise SimulationError(f"{self.policy_name} granted {key} at t={self.now:.6f}, "
                                      "which is not a rank waiting on this node")
            dev = node.devices[rank.device]
            dev.waiting -= 1
            rank.job.waits.append(self.now - rank.requested_at)
            self.compute_start(dev, rank)
            self.mark(dev)
        for key in node.policy.take_preemptions():
            rank = self.by_key[key]
            if self.cfg.yield_s is not None and rank.state == COMPUTE:
                self.push(self.now + self.cfg.yield_s, _YIELD, rank, rank.grants)
        self.arm_tick(node)

    def request(self, rank: RankState) -> None:
        node = self.nodes[rank.node]
        rank.state = WAITING
        rank.requested_at = self.now
        dev = node.devices[rank.device]
        dev.waiting += 1
        self.mark(dev)
        self.call(node, node.policy.request(rank.key, rank.job.turn_base + rank.iteration, self.now))

    def mark(self, dev: DeviceState) -> None:
        hungry = dev.waiting > 0 and not dev.computing
        if hungry != dev.hungry:
            dev.hungry = hungry
            if hungry:
                dev.node.hungry += 1
                dev.hungry_since = self.now
            else:
                dev.node.hungry -= 1
                dev.hungry_total += self.now - dev.hungry_since

    def arm_tick(self, node: NodeState) -> None:
        yields = self.cfg.yield_s is not None
        if not node.hungry and not yields:
            return  # a tick only matters to a device whose waiting ranks nobody serves (or, with yields, a cut turn)
        now = self.now
        if node.deadline is not None or (yields and not node.hungry):
            t = node.policy.next_deadline()
            if t is None or t <= now:
                return
        else:
            period = self.cfg.tick_s
            assert period, "a node reads its policy's deadlines unless ticks are periodic"
            t = node.phase + (math.floor((now - node.phase) / period) + 1) * period
            if t <= now:  # `now` sits on the grid up to rounding
                t += period
            d = node.policy.next_deadline() if yields else None  # a cut turn's end is kept on time
            if d is not None and now < d < t:
                t = d
        if node.tick_at is None or node.tick_at <= now or t < node.tick_at:
            node.tick_at = t
            self.push(t, _TICK, node)

    def on_tick(self, node: NodeState, _v: int) -> None:
        if node.tick_at != self.now:
            return  # superseded by an earlier deadline
        node.tick_at = None
        if not node.hungry and self.cfg.yield_s is None:
            return  # the wait it was armed for has ended
        if node.deadline is not None:
            t = node.deadline()
            if t is not None and t > self.now:  # that wait ended, and a later one began
                self.arm_tick(node)
                return
        self.call(node, node.policy.tick(self.now))

    # ---- compute: processor sharing per device ----

    def compute_start(self, dev: DeviceState, rank: RankState) -> None:
        rank.state = COMPUTE
        rank.granted_at = self.now
        rank.grants += 1
        if rank.left is None:
            rank.work = rank.mean_c * self.jitter(rank.job.spec.jitter)
            rank.held = 0.0
        else:
            rank.work, rank.left = rank.left, None
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
        if self._comm_slows and len(dev.computing) == 1:  # the link's allreduces now share the device
            self.rerate(self.links.get(dev.link, ()))

    def compute_stop(self, dev: DeviceState, rank: RankState) -> None:
        dev.computing.remove(rank)
        rank.version += 1
        if not dev.computing:
            dev.busy_total += self.now - dev.busy_since
        if self.cfg.record_trace:
            self.trace.append(ComputeSpan(rank.node, rank.device, rank.job.spec.name, rank.key.rank,
                                          rank.iteration, rank.granted_at, self.now))
        self.mark(dev)
        self.reshare(dev)
        if self._comm_slows and not dev.computing:
            self.rerate(self.links.get(dev.link, ()))

    def reshare(self, dev: DeviceState) -> None:
        k = len(dev.computing)
        if k == 0:
            return
        comm_beside = bool(self.cfg.interference) and any(job.comm_rate > 0 for job in self.links.get(dev.link, ()))
        rate = compute_rate(k, comm_beside, self.cfg.switch_penalty, self.cfg.interference)
        now = self.now
        for r in dev.computing:
            r.work = max(0.0, r.work - (now - r.since) * r.rate)
            r.since = now
            if r.rate != rate:
                r.rate = rate
                r.version += 1
                self.push(now + r.work / rate, _COMPUTE_DONE, r, r.version)

    def on_compute_done(self, rank: RankState, version: int) -> None:
        if version != rank.version or rank.state != COMPUTE:
            return
        node = self.nodes[rank.node]
        self.compute_stop(node.devices[rank.device], rank)
        rank.state = COMM
        rank.comm_began = self.now
        node.policy.observe(rank.key, "compute", rank.held + self.now - rank.granted_at, self.now)
        self.call(node, node.policy.release(rank.key, self.now))
        job = rank.job
        job.pending -= 1
        if job.pending == 0 and job.active:
            self.comm_start(job)

    def on_yield(self, rank: RankState, grant: int) -> None:
        """The rank asked to yield (`SimConfig.yield_s` ago, in its grant `grant`) hands its device back with
        the work its phase has left, and asks again for the same iteration."""
        if rank.state != COMPUTE or rank.grants != grant:
            return
        left = rank.work - (self.now - rank.since) * rank.rate
        if left <= 1e-9:
            return  # done at this instant: its completion event ends the phase
        node = self.nodes[rank.node]
        self.compute_stop(node.devices[rank.device], rank)
        rank.left = left
        rank.held += self.now - rank.granted_at
        rank.state = IDLE
        self.call(node, node.policy.release(rank.key, self.now))
        self.request(rank)

    # ---- allreduce: link sharing ----

    def comm_start(self, job: JobState) -> None:
        job.in_comm = True
        job.comm_work = job.spec.comm_s * self.jitter(job.spec.jitter)
        job.comm_since = self.now
        job.comm_rate = -1.0  # forces a rate (and, if it may run, a completion event) in `rerate`
        affected: dict[JobState, None] = {job: None}
        for link in job.links:
            sharing = self.links.setdefault(link, [])
            sharing.append(job)
            if self.cfg.shared_links and len(sharing) > 1:
                affected.update(dict.fromkeys(sharing))
        self.rerate(affected)
        self._reshare_links(affected)

    def comm_stop(self, job: JobState) -> None:
        job.in_comm = False
        job.comm_version += 1
        affected: dict[JobState, None] = {}
        for link in job.links:
            sharing = self.links[link]
            sharing.remove(job)
            if self.cfg.shared_links and sharing:
                affected.update(dict.fromkeys(sharing))
        self.rerate(affected)
        self._reshare_links({job: None, **affected})

    def _device(self, link: tuple[int, int]) -> DeviceState:
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
            if rate > 0 and self._comm_slows and any(self._device(link).computing for link in job.links):
                rate /= 1.0 + self._comm_slows
            if rate != job.comm_rate:
                job.comm_work = max(0.0, job.comm_work - (now - job.comm_since) * job.comm_rate)
                job.comm_since = now
                job.comm_rate = rate
                job.comm_version += 1
                if rate > 0:
                    self.push(now + job.comm_work / rate, _COMM_DONE, job, job.comm_version)

    def on_comm_done(self, job: JobState, version: int) -> None:
        if version != job.comm_version or not job.in_comm:
            return
        self.comm_stop(job)
        job.iter_ends.append(self.now)
        job.iteration += 1
        now = self.now
        skew = self.cfg.skew_s
        for rank in job.ranks:
            if not skew:
                self.nodes[rank.node].policy.observe(rank.key, "comm", now - rank.comm_began, now)
            rank.state = IDLE
            rank.iteration = job.iteration
        if job.spec.iterations is not None and job.iteration >= job.spec.iterations:
            self.leave_job(job, finished=True)
            return
        job.pending = len(job.ranks)
        for rank in job.ranks:
            if skew:
                self.push(now + self.rng.random() * skew, _REQUEST, rank, job.iteration)
            else:
                self.request(rank)

    def on_skewed_request(self, rank: RankState, iteration: int) -> None:
        """A rank's node learns late that its job's allreduce ended (`SimConfig.skew_s`): it measures the
        allreduce as it saw it, then asks for the device."""
        if not rank.job.active or rank.state != IDLE or rank.iteration != iteration:
            return
        self.nodes[rank.node].policy.observe(rank.key, "comm", self.now - rank.comm_began, self.now)
        self.request(rank)
