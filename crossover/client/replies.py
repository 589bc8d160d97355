"""What the daemon's Admin service answers, as typed records: what `AdminClient` returns and `crossover` prints.

Each record is built from its protobuf message in one place, its `from_pb`, field by field, so that a
proto field renamed or retyped changes this module and not what a script reads from `crossover ... --json`.
Words replace the wire's spellings: an enum is the word an operator types or reads in a table (a rank's
phase `compute`, a job's class `low`, `normal` or `high`; `unknown` for a value this client does not
know), a rank's hand-over is `device` or `cpu` (its CPU waits for the device: the wire's ""), a figure
the daemon could not measure (-1 on the wire) is None, and an optional field left unset is None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos.priority import name_of

__all__ = ["DeviceAck", "DeviceState", "EvictReply", "Isolation", "JobList", "JobState", "PolicyInfo",
           "QueueState", "RankState", "Reply"]

_PHASES: dict[int, str] = {pb.IDLE: "idle", pb.WAITING: "waiting", pb.COMPUTE: "compute", pb.COMM: "comm",
                           pb.OTHER: "other", pb.SUSPENDED: "suspended", pb.OVERDUE: "overdue"}


def _phase(value: int) -> str:
    """A rank's phase as `crossover queue` shows it; `unknown` for a value this client does not know."""
    return _PHASES.get(value, "unknown")


def _priority(value: int) -> str:
    """`low`, `normal` or `high`; `unknown` for PRIORITY_UNSPECIFIED (no daemon of this version sends it in a
    reply) or a class this client does not know."""
    return name_of(value) or "unknown"


def _measured(value: float) -> float | None:
    """None for the wire's -1: not measured (a CPU device's utilization, a process's first CPU read)."""
    return None if value < 0 else value


@dataclass(frozen=True)
class Isolation:
    """A device's isolation controller (crossoverd --protect): its protected job's pace, the lower classes'
    budget, and what each lower job held."""

    window: str                     # "solo" (the protected job measured alone) or "shared"
    target: float                   # the share of its speed alone the protected job is held at
    budget: float                   # device seconds per second the lower classes may hold now
    reference_s: float              # the protected job's iteration time alone (0: not measured yet)
    current_s: float                # its iteration time as last judged: latest shared windows pooled (0: not yet)
    lower_share: dict[str, float]   # lower job name -> device seconds per second it held, last window
    kept: float                     # the protected jobs' speed as last judged against alone, the least (0: not yet)

    @classmethod
    def from_pb(cls, msg: pb.Isolation) -> Isolation:
        return cls(window=msg.window, target=msg.target, budget=msg.budget, reference_s=msg.reference_s,
                   current_s=msg.current_s, lower_share=dict(msg.lower_share), kept=msg.kept)


@dataclass(frozen=True)
class RankState:
    """One rank on this node: who it is, what it does now, and what it costs."""

    job_id: str
    job_name: str
    rank: int
    local_rank: int
    pid: int
    phase: str                      # idle, waiting, compute, comm, other, suspended, overdue
    iteration: int
    mean_compute_s: float
    mean_comm_s: float
    wait_fraction: float            # share of wall time spent waiting for grants
    cpu_percent: float | None       # None: not measured yet
    rss_bytes: int
    gpu_memory_bytes: int
    since_s: float                  # time in the current phase
    user: str                       # its process's user ("": not known)
    priority: str                   # its job's class on this node: low, normal, high
    weight: float                   # its job's weight within the class
    handover: str                   # how its turns end: "device" (on the device) or "cpu" (its CPU waits for it)
    framework: str                  # "horovod", "ddp", or "" (an older client)
    device: int
    memory_cap_bytes: int | None    # what it may hold on its device; None: no cap
    memory_note: str                # its last out-of-memory at the cap ("": none)

    @classmethod
    def from_pb(cls, msg: pb.RankState) -> RankState:
        return cls(job_id=msg.job_id, job_name=msg.job_name, rank=msg.rank, local_rank=msg.local_rank, pid=msg.pid,
                   phase=_phase(msg.phase), iteration=msg.iteration, mean_compute_s=msg.mean_compute_s,
                   mean_comm_s=msg.mean_comm_s, wait_fraction=msg.wait_fraction,
                   cpu_percent=_measured(msg.cpu_percent), rss_bytes=msg.rss_bytes,
                   gpu_memory_bytes=msg.gpu_memory_bytes, since_s=msg.since_s, user=msg.user,
                   priority=_priority(msg.priority), weight=msg.weight, handover=msg.handover or "cpu",
                   framework=msg.framework, device=msg.device,
                   memory_cap_bytes=msg.memory_cap_bytes if msg.HasField("memory_cap_bytes") else None,
                   memory_note=msg.memory_note)


@dataclass(frozen=True)
class DeviceState:
    """One device's queue: its holders, its waiting ranks in grant order, the rest, and its figures."""

    index: int
    kind: str                       # "gpu" or "cpu"
    name: str
    draining: bool
    holders: tuple[RankState, ...]
    waiting: tuple[RankState, ...]  # in grant order
    others: tuple[RankState, ...]   # registered ranks neither holding nor waiting
    utilization: float | None       # percent; None: not measured (a CPU device)
    memory_used_bytes: int
    memory_total_bytes: int         # 0: not known
    memory_free_bytes: int
    order: tuple[str, ...]          # the policy's job order on this device, when it has one
    refused_while_draining: int     # ranks refused since the drain began
    sharing: str                    # "scheduled" or "unscheduled" where the daemon measures whether grants pay; ""
    sharing_reason: str
    isolation: Isolation | None     # None: no isolation controller holds this device

    @property
    def ranks(self) -> tuple[RankState, ...]:
        """Every rank on the device: holders, then waiting, then the others."""
        return self.holders + self.waiting + self.others

    @classmethod
    def from_pb(cls, msg: pb.DeviceState) -> DeviceState:
        return cls(index=msg.index, kind=msg.kind, name=msg.name, draining=msg.draining,
                   holders=tuple(map(RankState.from_pb, msg.holders)),
                   waiting=tuple(map(RankState.from_pb, msg.waiting)),
                   others=tuple(map(RankState.from_pb, msg.others)), utilization=_measured(msg.utilization),
                   memory_used_bytes=msg.memory_used_bytes, memory_total_bytes=msg.memory_total_bytes,
                   memory_free_bytes=msg.memory_free_bytes, order=tuple(msg.order),
                   refused_while_draining=msg.refused_while_draining, sharing=msg.sharing,
                   sharing_reason=msg.sharing_reason,
                   isolation=Isolation.from_pb(msg.isolation) if msg.HasField("isolation") else None)


@dataclass(frozen=True)
class QueueState:
    """The node's queues (`AdminClient.queue`): the daemon, its policy, and each device's queue."""

    node: str
    policy: str
    uptime_s: float
    devices: tuple[DeviceState, ...]
    overdue_total: int              # holders treated as stalled since the daemon started
    connections: int                # session streams open now
    max_connections: int            # the daemon's limit on them

    @classmethod
    def from_pb(cls, msg: pb.QueueState) -> QueueState:
        return cls(node=msg.node, policy=msg.policy, uptime_s=msg.uptime_s,
                   devices=tuple(map(DeviceState.from_pb, msg.devices)), overdue_total=msg.overdue_total,
                   connections=msg.connections, max_connections=msg.max_connections)


@dataclass(frozen=True)
class JobState:
    """One job with ranks on this node, and its class here (`AdminClient.set_job_class` answers with it)."""

    job_id: str
    job_name: str
    world_size: int
    ranks: tuple[RankState, ...]    # this node's ranks
    registered_s: float             # time since its first rank registered
    priority: str                   # its class on this node: low, normal, high
    weight: float                   # its weight within the class
    class_set_by: str               # "operator", "rule uid:1000", "rank" or "" (the default)
    framework: str                  # "horovod", "ddp", or "" (an older client)

    @classmethod
    def from_pb(cls, msg: pb.JobState) -> JobState:
        return cls(job_id=msg.job_id, job_name=msg.job_name, world_size=msg.world_size,
                   ranks=tuple(map(RankState.from_pb, msg.ranks)), registered_s=msg.registered_s,
                   priority=_priority(msg.priority), weight=msg.weight, class_set_by=msg.class_set_by,
                   framework=msg.framework)


@dataclass(frozen=True)
class JobList:
    """The jobs with ranks on this node (`AdminClient.jobs`)."""

    jobs: tuple[JobState, ...]

    @classmethod
    def from_pb(cls, msg: pb.JobList) -> JobList:
        return cls(jobs=tuple(map(JobState.from_pb, msg.jobs)))


@dataclass(frozen=True)
class PolicyInfo:
    """The node's policy and its switches (`AdminClient.policy`, `AdminClient.set_policy`)."""

    name: str
    available: tuple[str, ...]
    adapt: bool                     # each device measures whether its grants pay
    handover: bool                  # ranks that can end their turns on their device do
    protect: float                  # the isolation target (0: the controller off)

    @classmethod
    def from_pb(cls, msg: pb.PolicyInfo) -> PolicyInfo:
        return cls(name=msg.name, available=tuple(msg.available), adapt=msg.adapt, handover=msg.handover,
                   protect=msg.protect)


@dataclass(frozen=True)
class DeviceAck:
    """Whether a device now drains (`AdminClient.drain`, `AdminClient.resume`)."""

    device: int
    draining: bool

    @classmethod
    def from_pb(cls, msg: pb.DeviceAck) -> DeviceAck:
        return cls(device=msg.device, draining=msg.draining)


@dataclass(frozen=True)
class EvictReply:
    """What an eviction did (`AdminClient.evict`): one line per rank it touched; empty when none."""

    done: tuple[str, ...]

    @classmethod
    def from_pb(cls, msg: pb.EvictReply) -> EvictReply:
        return cls(done=tuple(msg.done))


Reply = Union[QueueState, JobList, JobState, PolicyInfo, DeviceAck, EvictReply]
"""Every record an AdminClient call answers with."""
