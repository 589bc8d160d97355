"""The simulated ranks, jobs, devices and nodes: mutable records that `world.World` updates as events happen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from crossover.daemon.api import Policy, RankKey, RankRef

from .spec import JobSpec

JOINING, IDLE, WAITING, COMPUTE, COMM, GONE = range(6)  # a rank's state


@dataclass(frozen=True)
class ComputeSpan:
    node: int
    device: int
    job: str
    rank: int
    iteration: int
    start: float
    end: float


class RankState:
    """One rank: where it runs, its phase (`state`) and the compute work it has left."""

    __slots__ = ("key", "ref", "job", "node", "device", "mean_c", "state", "work", "rate", "since",
                 "version", "granted_at", "requested_at", "comm_began", "iteration", "grants", "left", "held")

    def __init__(self, key: RankKey, ref: RankRef, job: JobState, node: int, mean_c: float) -> None:
        self.key, self.ref, self.job, self.node, self.device, self.mean_c = key, ref, job, node, ref.device, mean_c
        self.state = JOINING
        self.work = self.rate = self.since = 0.0
        self.version = 0
        self.granted_at = self.requested_at = self.comm_began = 0.0
        self.iteration = 0
        self.grants = 0  # grants so far: a yield asked during one is not honoured in the next
        self.left: float | None = None  # work its phase has left after a yield (None: a new phase)
        self.held = 0.0  # device time its phase held before its latest grant (its yields)


class JobState:
    """One job: its ranks, its iteration, its allreduce in flight and what it measured."""

    __slots__ = ("spec", "id", "ranks", "joined", "pending", "iteration", "links", "comm_work", "comm_rate",
                 "comm_since", "comm_version", "in_comm", "iter_ends", "started_at", "left_at", "active",
                 "finished", "waits", "turn_base")

    def __init__(self, spec: JobSpec, job_id: str) -> None:
        self.spec, self.id = spec, job_id
        self.turn_base = 0
        self.ranks: list[RankState] = []
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


class DeviceState:
    """One (node, device): who computes on it, how many wait, and how long it was busy, hungry, used."""

    __slots__ = ("node", "link", "computing", "waiting", "hungry", "hungry_since", "hungry_total", "present",
                 "present_since", "present_total", "busy_since", "busy_total")

    def __init__(self, node: NodeState, link: tuple[int, int]) -> None:
        self.node = node
        self.link = link  # the (node, device) link its ranks' allreduces cross
        self.computing: list[RankState] = []
        self.waiting = 0
        self.hungry = False  # ranks wait and none computes: the only state in which a tick can matter
        self.hungry_since = self.hungry_total = 0.0
        self.present = 0
        self.present_since = self.present_total = self.busy_since = self.busy_total = 0.0


class NodeState:
    """One node: its policy instance (one daemon), its devices and its next tick."""

    __slots__ = ("policy", "devices", "tick_at", "phase", "deadline", "hungry")

    def __init__(self, index: int, policy: Policy, n_devices: int, phase: float,
                 deadline: Callable[[], float | None] | None) -> None:
        self.policy = policy
        self.devices = [DeviceState(self, (index, d)) for d in range(n_devices)]
        self.hungry = 0  # devices with ranks waiting and none computing
        self.tick_at: float | None = None
        self.phase = phase
        self.deadline = deadline
