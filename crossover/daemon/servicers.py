"""The gRPC services: each call translated to the scheduler core and back.

Domain errors become gRPC status codes with the message intact; everything
else about a rank is the scheduler's business. Who may call is each server's
`rights.Gate`, decided before any handler here runs.
"""
from __future__ import annotations

from typing import Any, Callable

import grpc

from crossover.daemon import policies
from crossover.daemon.api import PROTOCOL_VERSION, CrossoverError, InvalidRequest, Phase, UnsupportedVersion
from crossover.daemon.grant_payoff import Verdict
from crossover.daemon.limits import Connections, StreamLimits
from crossover.daemon.policies.classes import Priority
from crossover.daemon.policies.isolation import IsolationView
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.session_grpc import GrpcSessionStream, serve_session
from crossover.daemon.session_stream import refusal
from crossover.daemon.snapshots import RankSnapshot
from crossover.daemon.steering import Steering
from crossover.protos import USER_METADATA_KEY
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from crossover.protos.priority import name_of, to_wire

__all__ = ["AdminService", "SchedulerService"]

_PHASES = {
    Phase.IDLE: pb.IDLE,
    Phase.WAITING: pb.WAITING,
    Phase.COMPUTE: pb.COMPUTE,
    Phase.COMM: pb.COMM,
    Phase.OTHER: pb.OTHER,
    Phase.SUSPENDED: pb.SUSPENDED,
    Phase.OVERDUE: pb.OVERDUE,
}


def _caller(context: grpc.ServicerContext) -> str:
    """Who made a steering call, for the record: the way in (only the daemon's user or its admin group
    reach the admin socket; over TCP, the admin token's holder) and the user the CLI says it runs as,
    which nothing checks."""
    peer = context.peer() or "?"
    way = "admin socket" if peer.startswith("unix:") else f"{peer} with the admin token"
    claimed = next((v for k, v in context.invocation_metadata() or () if k == USER_METADATA_KEY), "")
    claimed = "".join(c for c in str(claimed)[:64] if c.isprintable())
    return f"{way}, user {claimed} (as the client says)" if claimed else way


def _check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol_version={version} is not supported by this daemon (it speaks {PROTOCOL_VERSION}); "
            "upgrade the client or the daemon so they match"
        )


class _Service:
    """Shared by both services: the scheduler core and the session streams' limits and count.
    Who may call is each server's `rights.Gate`."""

    def __init__(self, core: Scheduler, limits: StreamLimits, connections: Connections) -> None:
        self._core = core
        self._limits = limits
        self._connections = connections


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A unary call's one way in: the request's protocol version is checked first, and a `CrossoverError`
    ends the call with its status (`refusal`)."""
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _check_version(request.protocol_version)
            return fn(self, request, context)
        except CrossoverError as exc:
            context.abort(*refusal(exc))

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class SchedulerService(_Service, pb_grpc.SchedulerServicer):

    def __init__(self, core: Scheduler, limits: StreamLimits, connections: Connections,
                 session_socket: str = "") -> None:
        super().__init__(core, limits, connections)
        self._session_socket = session_socket

    @_unary
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        if not request.HasField("identity"):
            raise InvalidRequest("identity is missing")
        reg = self._core.register(RankIdentity.from_pb(request.identity), accepts_leases=request.accepts_leases,
                                  asked=_priority(request.priority),
                                  accepts_preempt=request.accepts_preempt,
                                  accepts_handover=request.accepts_handover)
        return pb.RegisterResponse(
            session_id=reg.session_id,
            node=reg.node,
            device=reg.device,
            cpu_affinity=list(reg.cpu_affinity),
            heartbeat_interval_s=reg.heartbeat_interval_s,
            policy=reg.policy,
            policy_blocks=reg.policy_blocks,
            # Offered to local peers only: a path means nothing on another node.
            session_socket=self._session_socket if context.peer().startswith("unix:") else "",
        )

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        # Runs on the event loop: reading an event, deciding and writing the grant
        # happen on one thread, which keeps the grant round trip short.
        await serve_session(self._core, GrpcSessionStream(context), self._limits, self._connections)


def _priority(value: int) -> Priority | None:
    """The class a request names; None for PRIORITY_UNSPECIFIED; an unknown value is refused."""
    if value == pb.PRIORITY_UNSPECIFIED:
        return None
    name = name_of(value)
    if name is None:
        raise InvalidRequest(f"priority {value} is not one of PRIORITY_LOW, _NORMAL, _HIGH")
    return Priority.parse(name)


def _rank_state(r: RankSnapshot, gpu_mem: dict[int, int]) -> pb.RankState:
    i = r.ident
    return pb.RankState(
        job_id=i.job_id, job_name=i.job_name, rank=i.rank, local_rank=i.local_rank, pid=i.pid,
        phase=_PHASES[r.phase], iteration=r.iteration, mean_compute_s=r.mean_compute_s,
        mean_comm_s=r.mean_comm_s, wait_fraction=r.wait_fraction, cpu_percent=r.cpu_percent,
        rss_bytes=r.rss_bytes, gpu_memory_bytes=gpu_mem.get(i.pid, 0), since_s=r.since_s, user=r.user,
        priority=to_wire(r.priority), weight=r.weight, handover=r.handover, framework=i.framework,
        device=r.device, memory_cap_bytes=r.memory_cap, memory_note=r.memory_note,
    )


class AdminService(_Service, pb_grpc.AdminServicer):
    """The operator's calls: what `crossover` shows and steers, through the scheduler's `steering`."""

    @property
    def _steer(self) -> Steering:
        return self._core.steering

    @_unary
    def GetQueue(self, request: pb.QueueRequest, context: grpc.ServicerContext) -> pb.QueueState:
        if request.device >= 0:
            self._core.inventory.by_index(request.device)
        per_device, _ = self._steer.snapshot()
        out = pb.QueueState(node=self._core.node, policy=self._steer.policy_name, uptime_s=self._steer.uptime(),
                             overdue_total=self._core.liveness.overdue_total, connections=self._connections.count,
                             max_connections=self._connections.cap)
        for dev in self._core.inventory.devices:
            if request.device >= 0 and dev.index != request.device:
                continue
            holders, waiting, others, order = per_device[dev.index]
            st = self._core.inventory.stats(dev.index)
            mem = st.process_memory
            out.devices.append(pb.DeviceState(
                index=dev.index, kind=dev.kind, name=dev.name, draining=self._steer.is_draining(dev.index),
                holders=[_rank_state(r, mem) for r in holders], waiting=[_rank_state(r, mem) for r in waiting],
                others=[_rank_state(r, mem) for r in others], utilization=st.utilization,
                memory_used_bytes=st.memory_used, memory_total_bytes=st.memory_total or dev.memory_total,
                memory_free_bytes=st.memory_free, order=list(order),
                refused_while_draining=self._steer.drain_refusals(dev.index),
                **_sharing(self._steer.sharing(dev.index)), isolation=_isolation(self._steer.isolation(dev.index)),
            ))
        return out

    @_unary
    def ListJobs(self, request: pb.JobsRequest, context: grpc.ServicerContext) -> pb.JobList:
        return pb.JobList(jobs=list(self._jobs().values()))

    def _jobs(self) -> dict[str, pb.JobState]:
        """Each job with ranks on this node, by id, as `crossover jobs` shows it."""
        _, ranks = self._steer.snapshot()
        mem: dict[int, int] = {}
        for dev in {r.device for r in ranks}:
            mem.update(self._core.inventory.stats(dev).process_memory)
        jobs: dict[str, pb.JobState] = {}
        for r in sorted(ranks, key=lambda r: (r.ident.job_name, r.ident.rank)):
            i = r.ident
            job = jobs.setdefault(i.job_id, pb.JobState(
                job_id=i.job_id, job_name=i.job_name, world_size=i.world_size,
                priority=to_wire(r.priority), weight=r.weight, class_set_by=r.class_by, framework=i.framework))
            job.ranks.append(_rank_state(r, mem))
            job.registered_s = max(job.registered_s, r.registered_s)
        return jobs

    @_unary
    def GetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        return self._policy_info()

    def _policy_info(self) -> pb.PolicyInfo:
        return pb.PolicyInfo(name=self._steer.policy_name, available=policies.available(), adapt=self._steer.adapting,
                             handover=self._steer.handing_over, protect=self._steer.protect)

    @_unary
    def SetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        protect = request.protect if request.HasField("protect") else None
        if not request.name and protect is None and request.adapt == request.handover == pb.ADAPT_UNCHANGED:
            raise InvalidRequest("name is empty; give the policy to switch to")
        for what, value in (("adapt", request.adapt), ("handover", request.handover)):
            if value not in (pb.ADAPT_UNCHANGED, pb.ADAPT_ON, pb.ADAPT_OFF):
                raise InvalidRequest(f"{what} {value} is not one of ADAPT_UNCHANGED, ADAPT_ON, ADAPT_OFF")
        if request.name or protect is not None:
            self._steer.set_policy(request.name or self._steer.policy_name, caller=_caller(context), protect=protect)
        if request.adapt != pb.ADAPT_UNCHANGED:
            self._steer.set_adapt(request.adapt == pb.ADAPT_ON, caller=_caller(context))
        if request.handover != pb.ADAPT_UNCHANGED:
            self._steer.set_handover(request.handover == pb.ADAPT_ON, caller=_caller(context))
        return self._policy_info()

    @_unary
    def Drain(self, request: pb.DeviceRequest, context: grpc.ServicerContext) -> pb.DeviceAck:
        return pb.DeviceAck(device=request.device, draining=self._steer.drain(request.device, True, _caller(context)))

    @_unary
    def Resume(self, request: pb.DeviceRequest, context: grpc.ServicerContext) -> pb.DeviceAck:
        return pb.DeviceAck(device=request.device,
                            draining=self._steer.drain(request.device, False, _caller(context)))

    @_unary
    def SetJobClass(self, request: pb.JobClassRequest, context: grpc.ServicerContext) -> pb.JobState:
        if not request.job:
            raise InvalidRequest("name the job (its id or name; `crossover jobs` lists them)")
        asked = _priority(request.priority)
        if request.weight != 0 and not 0.01 <= request.weight <= 100:
            raise InvalidRequest(f"weight {request.weight}: must be within 0.01..100")
        if request.priority == pb.PRIORITY_UNSPECIFIED and request.weight == 0:
            raise InvalidRequest("give a priority, a weight, or both")
        job_id, cls = self._core.ownership.set_job_class(request.job, asked,
                                               request.weight or None, caller=_caller(context))
        job = self._jobs().get(job_id) or pb.JobState(job_id=job_id)  # the job as `crossover jobs` shows it now
        job.priority = pb.Priority.Value(to_wire(str(cls.priority)))
        job.weight, job.class_set_by = cls.weight, "operator"
        return job

    @_unary
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictReply:
        if request.device < 0 and not request.job:
            raise InvalidRequest("name a device or a job to evict")
        return pb.EvictReply(done=self._steer.evict(request.device, request.job, _caller(context)))


def _isolation(view: IsolationView | None) -> pb.Isolation | None:
    """A device's isolation controller on the wire; None (the field unset) while it has none."""
    if view is None:
        return None
    return pb.Isolation(window=view.window.value, target=view.target, budget=view.budget,
                        reference_s=view.reference_s or 0.0, current_s=view.current_s or 0.0,
                        lower_share=view.lower_share, kept=view.kept or 0.0)


def _sharing(verdict: Verdict | None) -> dict[str, str]:
    """A device's `sharing` fields: its mode and why, when the daemon measures whether grants pay."""
    if verdict is None:
        return {}
    return {"sharing": verdict.mode.value, "sharing_reason": verdict.reason}
