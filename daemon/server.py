"""gRPC edge of `crossoverd`: translates the wire contract to the scheduler core.

Domain errors become gRPC status codes with the message intact; everything
else about a rank is the scheduler's business.

Who may call what is decided by where the call arrives, before any handler
runs (`_Gate`, a server interceptor), one server per way in:
- the rank socket (0660): ranks and readers; the admin calls that change state
  (`ADMIN_CALLS`) are refused with PERMISSION_DENIED;
- the admin socket beside it (0600, or 0660 for --admin-group): every call;
- TCP: every call needs the shared token, the admin calls the admin token
  (none without --admin-token-file). Tokens are compared in constant time.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import stat
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Optional

import grpc

from ..protos import STEERING_CALLS, TOKEN_METADATA_KEY, admin_socket_path, framing
from ..protos import crossover_v1_pb2 as pb
from ..protos import crossover_v1_pb2_grpc as pb_grpc
from . import policies
from .api import PROTOCOL_VERSION, CrossoverError, FailedPrecondition, InvalidRequest, Phase, UnsupportedVersion
from .limits import Connections, StreamLimits
from .scheduler import Identity, RankSnapshot, Scheduler
from .session_stream import GrpcSessionStream, SessionSocketServer, error_text, serve_session, status_code

__all__ = ["ADMIN_CALLS", "Daemon", "status_code"]

ADMIN_CALLS = frozenset(f"/crossover.v1.Admin/{name}" for name in STEERING_CALLS)

_log = logging.getLogger(__name__)

_PHASES = {
    Phase.IDLE: pb.IDLE,
    Phase.WAITING: pb.WAITING,
    Phase.COMPUTE: pb.COMPUTE,
    Phase.COMM: pb.COMM,
    Phase.OTHER: pb.OTHER,
    Phase.SUSPENDED: pb.SUSPENDED,
    Phase.OVERDUE: pb.OVERDUE,
}


def _check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol_version={version} is not supported by this daemon (it speaks {PROTOCOL_VERSION}); "
            "upgrade the client or the daemon so they match"
        )


_Refusal = tuple[grpc.StatusCode, str]  # how a call is refused
_Rule = Callable[[str, dict], Optional[_Refusal]]  # (method, metadata) -> a refusal, or None: the call goes on


class _Gate(grpc.aio.ServerInterceptor):
    """Refuses the calls its rule refuses before any handler runs (a server's only way in).

    The refusal is a handler of the call's own shape that aborts, so a refused
    call reaches no service code at all.
    """

    def __init__(self, rule: _Rule) -> None:
        self._rule = rule

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        refusal = None if handler is None else self._rule(details.method, dict(details.invocation_metadata or ()))
        if refusal is None:
            return handler
        code, message = refusal

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        shape = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        make = shape[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def _rank_socket_rule(admin_socket: str | None) -> _Rule:
    where = f"the admin socket {admin_socket}" if admin_socket else "no admin socket here"

    def rule(method: str, _metadata: dict) -> _Refusal | None:
        if method in ADMIN_CALLS:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method.rsplit('/', 1)[-1]} is an admin call; this daemon takes it on {where} "
                    "(`crossover` uses it by itself)")
        return None

    return rule


def _tcp_rule(token: str, admin_token: str | None) -> _Rule:
    rank_key, admin_key = token.encode(), admin_token.encode() if admin_token else None

    def rule(method: str, metadata: dict) -> _Refusal | None:
        given = str(metadata.get(TOKEN_METADATA_KEY, "")).encode()
        is_admin = admin_key is not None and hmac.compare_digest(given, admin_key)
        if not is_admin and not hmac.compare_digest(given, rank_key):
            return grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY} metadata"
        if method in ADMIN_CALLS and not is_admin:
            why = "the admin token" if admin_key else "an admin token, and this daemon has none (--admin-token-file)"
            return grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[-1]} over TCP needs {why}"
        return None

    return rule


class _Service:
    """Shared by both services: the scheduler core and the session streams' limits and count.
    Who may call is each server's `_Gate`."""

    def __init__(self, core: Scheduler, limits: StreamLimits, connections: Connections) -> None:
        self._core = core
        self._limits = limits
        self._connections = connections


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except CrossoverError as exc:
            context.abort(status_code(exc), error_text(exc))

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class _SchedulerService(_Service, pb_grpc.SchedulerServicer):

    def __init__(self, core: Scheduler, limits: StreamLimits, connections: Connections,
                 session_socket: str = "") -> None:
        super().__init__(core, limits, connections)
        self._session_socket = session_socket

    @_unary
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        _check_version(request.protocol_version)
        if not request.HasField("identity"):
            raise InvalidRequest("identity is missing")
        i = request.identity
        reg = self._core.register(
            Identity(i.job_id, i.job_name, i.rank, i.local_rank, i.world_size, i.local_size, i.node, i.device, i.pid),
            accepts_leases=request.accepts_leases,
        )
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

    @_unary
    def TurnFloor(self, request: pb.TurnFloorRequest, context: grpc.ServicerContext) -> pb.TurnFloorResponse:
        if not request.session_id:
            raise InvalidRequest("session_id is missing")
        return pb.TurnFloorResponse(floor=self._core.turn_floor(request.session_id))

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        # Runs on the event loop: reading an event, deciding and writing the grant
        # happen on one thread, which keeps the grant round trip short.
        await serve_session(self._core, GrpcSessionStream(context), self._limits, self._connections)


def _rank_state(r: RankSnapshot, gpu_mem: dict[int, int]) -> pb.RankState:
    i = r.ident
    return pb.RankState(
        job_id=i.job_id, job_name=i.job_name, rank=i.rank, local_rank=i.local_rank, pid=i.pid,
        phase=_PHASES[r.phase], iteration=r.iteration, mean_compute_s=r.mean_compute_s,
        mean_comm_s=r.mean_comm_s, wait_fraction=r.wait_fraction, cpu_percent=r.cpu_percent,
        rss_bytes=r.rss_bytes, gpu_memory_bytes=gpu_mem.get(i.pid, 0), since_s=r.since_s,
    )


class _AdminService(_Service, pb_grpc.AdminServicer):

    @_unary
    def GetQueue(self, request: pb.QueueRequest, context: grpc.ServicerContext) -> pb.QueueState:
        _check_version(request.protocol_version)
        if request.device >= 0:
            self._core.inventory.by_index(request.device)
        per_device, _ = self._core.snapshot()
        out = pb.QueueState(node=self._core.node, policy=self._core.policy_name, uptime_s=self._core.uptime(),
                             overdue_total=self._core.overdue_total, connections=self._connections.count,
                             max_connections=self._connections.cap)
        for dev in self._core.inventory.devices:
            if request.device >= 0 and dev.index != request.device:
                continue
            holders, waiting, others, order = per_device[dev.index]
            st = self._core.inventory.stats(dev.index)
            mem = st.process_memory
            out.devices.append(pb.DeviceState(
                index=dev.index, kind=dev.kind, name=dev.name, draining=self._core.is_draining(dev.index),
                holders=[_rank_state(r, mem) for r in holders], waiting=[_rank_state(r, mem) for r in waiting],
                others=[_rank_state(r, mem) for r in others], utilization=st.utilization,
                memory_used_bytes=st.memory_used, memory_total_bytes=st.memory_total, order=list(order),
            ))
        return out

    @_unary
    def ListJobs(self, request: pb.JobsRequest, context: grpc.ServicerContext) -> pb.JobList:
        _check_version(request.protocol_version)
        _, ranks = self._core.snapshot()
        jobs: dict[str, pb.JobState] = {}
        for r in sorted(ranks, key=lambda r: (r.ident.job_name, r.ident.rank)):
            i = r.ident
            job = jobs.setdefault(i.job_id, pb.JobState(job_id=i.job_id, job_name=i.job_name, world_size=i.world_size))
            job.ranks.append(_rank_state(r, {}))
            job.registered_s = max(job.registered_s, r.registered_s)
        return pb.JobList(jobs=list(jobs.values()))

    @_unary
    def GetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        _check_version(request.protocol_version)
        return pb.PolicyInfo(name=self._core.policy_name, available=policies.available())

    @_unary
    def SetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        _check_version(request.protocol_version)
        if not request.name:
            raise InvalidRequest("name is empty; give the policy to switch to")
        self._core.set_policy(request.name)
        return pb.PolicyInfo(name=self._core.policy_name, available=policies.available())

    @_unary
    def Drain(self, request: pb.DeviceRequest, context: grpc.ServicerContext) -> pb.DeviceAck:
        _check_version(request.protocol_version)
        return pb.DeviceAck(device=request.device, draining=self._core.drain(request.device, True))

    @_unary
    def Resume(self, request: pb.DeviceRequest, context: grpc.ServicerContext) -> pb.DeviceAck:
        _check_version(request.protocol_version)
        return pb.DeviceAck(device=request.device, draining=self._core.drain(request.device, False))


def _socket_folder(folder: Path) -> None:
    """Create the socket's folder 0770 (whatever the umask), or accept an existing one only
    if this user (or root) owns it and other users cannot replace what is in it (not
    writable by others, or sticky like /tmp): otherwise they could swap our socket for theirs."""
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o770)
        os.chmod(folder, 0o770)
        return
    st = folder.stat()
    if st.st_uid not in (os.geteuid(), 0):
        raise FailedPrecondition(f"{folder} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                                 "refusing to serve a socket there")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise FailedPrecondition(f"{folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                                 "refusing to serve a socket there")


def _clear_socket_path(path: Path) -> None:
    """Make room for a socket: prepare its folder, remove a stale socket, refuse to replace anything else."""
    _socket_folder(path.parent)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FailedPrecondition(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()


class Daemon:
    """A running `crossoverd`: gRPC server (asyncio, on its own thread), scheduler core, liveness reaper."""

    def __init__(
        self,
        core: Scheduler,
        socket_path: str | None,
        listen: str | None = None,
        token: str | None = None,
        tls: tuple[bytes, bytes] | None = None,
        reap_interval_s: float = 0.1,
        max_workers: int = 32,
        session_socket: bool = True,
        limits: StreamLimits | None = None,
        admin_token: str | None = None,
        socket_group: int | None = None,
        admin_group: int | None = None,
    ) -> None:
        """`socket_group` (a gid) may reach the rank sockets (ranks run as its members); the admin
        socket is the daemon user's alone unless `admin_group` may use it too."""
        if listen and not token:
            raise InvalidRequest("--listen needs --token (or --token-file): TCP calls must be authenticated")
        if not socket_path and not listen:
            raise InvalidRequest("nothing to listen on: give a socket path or --listen")
        self.core = core
        self.socket_path = socket_path
        # Beside the gRPC socket, a socket for Session streams as frames (see session_stream).
        self.session_socket = f"{socket_path}.session" if socket_path and session_socket else None
        self.admin_socket = admin_socket_path(socket_path) if socket_path else None
        self._admin_token = admin_token
        self._socket_group = socket_group
        self._admin_group = admin_group
        self._session_server: SessionSocketServer | None = None
        self.listen = listen
        self.port: int | None = None
        self._token = token
        self._tls = tls
        self._max_workers = max_workers
        self.limits = limits or StreamLimits()
        self.connections = Connections(self.limits.max_connections)
        self._stop = threading.Event()
        self._reap_interval = reap_interval_s
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self._servers: list[grpc.aio.Server] = []
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)

    def _sockets(self) -> list[str]:
        return [s for s in (self.socket_path, self.session_socket, self.admin_socket) if s]

    def start(self) -> Daemon:
        for sock in self._sockets():
            _clear_socket_path(Path(sock))
        if self.socket_path and self._socket_group is not None:
            os.chown(Path(self.socket_path).parent, -1, self._socket_group)
        self._loop_thread.start()
        old = os.umask(0o177)  # every socket is 0600 from the moment it exists, opened up below
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        finally:
            os.umask(old)
        for path, group in ((self.socket_path, self._socket_group), (self.session_socket, self._socket_group),
                            (self.admin_socket, self._admin_group)):
            if not path:
                continue
            if group is not None:
                os.chown(path, -1, group)
            os.chmod(path, 0o600 if path == self.admin_socket and group is None else 0o660)
        self._reaper.start()
        _log.info("crossoverd serving on %s%s%s%s (policy %s, %d device(s))",
                  self.socket_path or "", f" and {self.listen}" if self.listen else "",
                  f"; session streams also on {self.session_socket}" if self.session_socket else "",
                  f"; admin calls on {self.admin_socket}" if self.admin_socket else "",
                  self.core.policy_name, len(self.core.inventory.devices))
        return self

    async def _serve(self) -> None:
        if self.session_socket:
            try:
                self._session_server = SessionSocketServer(self.core, self.session_socket, self.limits,
                                                           self.connections)
                self._session_server.start()
            except OSError as exc:  # e.g. a path too long for AF_UNIX: the gRPC stream still works
                _log.warning("no session socket at %s (%s); ranks use the gRPC stream", self.session_socket, exc)
                self._session_server = None
                self.session_socket = None
        # One server per way in, so that each server's gate sees every call that arrives its way.
        pool = futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="admin")
        if self.socket_path:
            server = self._grpc_server(pool, interceptors=(_Gate(_rank_socket_rule(self.admin_socket)),))
            server.add_insecure_port(f"unix://{self.socket_path}")
            await server.start()
            self._servers.append(server)
        if self.admin_socket:
            server = self._grpc_server(pool, interceptors=())
            server.add_insecure_port(f"unix://{self.admin_socket}")
            await server.start()
            self._servers.append(server)
        if self.listen:
            assert self._token  # __init__ refuses --listen without one
            server = self._grpc_server(pool, interceptors=(_Gate(_tcp_rule(self._token, self._admin_token)),))
            if self._tls:
                creds = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
                self.port = server.add_secure_port(self.listen, creds)
            else:
                self.port = server.add_insecure_port(self.listen)
            await server.start()
            self._servers.append(server)

    def _grpc_server(self, pool: futures.ThreadPoolExecutor, interceptors: tuple) -> grpc.aio.Server:
        # Session streams are capped by `connections` (a clear refusal); the RPC cap above it only
        # bounds what a flood of other calls can hold. Keepalive pings find peers that vanished
        # without closing (a half-open TCP connection); idle connections are closed.
        server = grpc.aio.server(
            migration_thread_pool=pool, interceptors=interceptors,
            maximum_concurrent_rpcs=self.limits.max_connections + 64,
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", framing.MAX_FRAME),
                     ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                     ("grpc.max_connection_idle_ms", int(self.limits.idle_timeout_s * 1000) * 5)])
        pb_grpc.add_SchedulerServicer_to_server(
            _SchedulerService(self.core, self.limits, self.connections, self.session_socket or ""), server)
        pb_grpc.add_AdminServicer_to_server(_AdminService(self.core, self.limits, self.connections), server)
        return server

    def stop(self, grace: float = 1.0) -> None:
        """Fail open: release every waiting rank, then stop serving."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.core.shutdown()
        if self._session_server is not None:
            self._session_server.stop()
        for server in self._servers:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace), self._loop).result(timeout=grace + 5)
            except Exception:  # stopping must not fail the shutdown path
                _log.exception("gRPC server did not stop cleanly")
        self._loop.call_soon_threadsafe(self._loop.stop)
        for sock in self._sockets():
            try:
                # Only our socket: after a failed start() the path may be a file we refused to replace.
                if stat.S_ISSOCK(os.lstat(sock).st_mode):
                    os.unlink(sock)
            except FileNotFoundError:
                pass
        _log.info("crossoverd stopped")

    def wait(self) -> None:
        self._stop.wait()

    def _reap_loop(self) -> None:
        # Evictions run every reap interval; the policy's bounded waits end on time:
        # the loop sleeps until the nearest deadline, and is woken when a new one appears.
        next_reap = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            deadline = self.core.next_deadline()
            until = min(next_reap, deadline) if deadline is not None else next_reap
            self.core.deadline_changed.wait(max(0.0, min(self._reap_interval, until - now)))
            self.core.deadline_changed.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_reap:
                    self.core.reap()
                    next_reap = time.monotonic() + self._reap_interval
                else:
                    self.core.tick()
            except Exception:  # never let the liveness loop die
                _log.exception("reaper pass failed")
