"""`crossoverd` serving: its sockets, one gRPC server per way in, the session socket and the liveness loop.

Each way in has its own server and `rights.Gate`: the rank socket, the admin
socket beside it, and TCP (see `rights`). The services themselves are in
`servicers`; session streams also arrive as frames on the session socket
(`session_socket`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crossover.daemon.api import FailedPrecondition, InvalidRequest
from crossover.daemon.limits import Connections, StreamLimits
from crossover.daemon.rights import Gate, rank_socket_rule, tcp_rule
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.servicers import AdminService, SchedulerService
from crossover.daemon.session_socket import SessionSocketServer
from crossover.protos import admin_socket_path, framing
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc

__all__ = ["Daemon", "Endpoints"]

_log = logging.getLogger(__name__)

# "" is the whole server, as probes ask by default.
_HEALTH_SERVICES = ("", *(s.full_name for s in pb.DESCRIPTOR.services_by_name.values()))
# Calls the probe port serves at once: probes ask one Check at a time; more is a flood.
_PROBE_CALLS = 256


class _HealthService(health_aio.HealthServicer):
    """grpc.health.v1 on the event loop: a call, a Watch stream included, holds no thread, so no
    number of them can take the threads that the control plane's calls run on."""


class _ProbeHealthService(_HealthService):
    """The probe port's health service: Check only. Probes (the kubelet's gRPC probe among them)
    call Check; a Watch is a stream that anyone who reaches the port could hold open."""

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the probe port serves Check only")


def _socket_folder(folder: Path) -> None:
    """Create the socket's folder 0750 (whatever the umask): the socket group may reach the sockets
    but not add, rename or remove anything there. An existing folder is accepted only if this user
    (or root) owns it and no other user can replace what is in it: ours, it is made 0750 (an older
    daemon made it 0770); root's, it must not be writable by group or others unless sticky like /tmp."""
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o750)
        os.chmod(folder, 0o750)
        return
    st = folder.stat()
    if st.st_uid not in (os.geteuid(), 0):
        raise FailedPrecondition(f"{folder} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                                 "refusing to serve a socket there")
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_mode & stat.S_ISVTX:
        return
    if st.st_uid == os.geteuid():
        _log.warning("%s was writable by other users (mode %o); making it 0750 so that none can replace "
                     "the sockets", folder, stat.S_IMODE(st.st_mode))
        os.chmod(folder, 0o750)
        return
    raise FailedPrecondition(f"{folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                             "refusing to serve a socket there")


def _clear_socket_path(path: Path) -> None:
    """Make room for a socket: prepare its folder, remove a stale socket, refuse to replace anything else,
    and never take the socket of a daemon that still answers there."""
    _socket_folder(path.parent)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FailedPrecondition(f"{path} exists and is not a socket; refusing to replace it")
        serving = _answers(path)
        if serving is not None:
            who = f" (pid {serving})" if serving > 0 else ""
            raise FailedPrecondition(f"another crossoverd{who} serves {path}; stop it first, or give this one "
                                     "another --socket")
        path.unlink()


def _answers(path: Path) -> int | None:
    """The pid of whatever accepts connections on a Unix socket (a live daemon; 0 when the kernel does
    not say), or None when nothing does (a stale socket)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return None
    try:
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    except OSError:
        return 0
    finally:
        probe.close()


def _open_up(path: str, group: int | None, mode: int) -> None:
    """Give a socket this daemon just bound its group and mode, never what a link there points at."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise FailedPrecondition(f"{path} is no longer the socket this daemon bound; refusing to open it up")
    if group is not None:
        os.chown(path, -1, group, follow_symlinks=False)
    os.chmod(path, mode)


@dataclass(frozen=True)
class Endpoints:
    """Where a daemon serves and whom it lets in, as `crossoverd`'s flags say.

    `socket_path`: the rank socket (None: TCP only), with the admin socket beside it and, with
    `session_socket`, the session socket; `listen` (HOST:PORT): TCP too, for callers with `token`
    (and `admin_token` to steer), over TLS with `tls` (certificate, key; PEM). `socket_group` (a gid)
    may reach the rank sockets (ranks run as its members); the admin socket is the daemon user's alone
    unless `admin_group` may use it too. `health_address` (HOST:PORT) serves only the gRPC health
    service, in plain text, for probes."""

    socket_path: str | None = None
    listen: str | None = None
    token: str | None = field(default=None, repr=False)
    tls: tuple[bytes, bytes] | None = field(default=None, repr=False)
    session_socket: bool = True
    admin_token: str | None = field(default=None, repr=False)
    socket_group: int | None = None
    admin_group: int | None = None
    health_address: str | None = None


class Daemon:
    """A running `crossoverd`: gRPC server (asyncio, on its own thread), scheduler core, liveness reaper."""

    def __init__(self, core: Scheduler, endpoints: Endpoints, limits: StreamLimits = StreamLimits(), *,
                 reap_interval_s: float = 0.1, max_workers: int = 32) -> None:
        socket_path, listen = endpoints.socket_path, endpoints.listen
        if listen and not endpoints.token:
            raise InvalidRequest("--listen needs --token (or --token-file): TCP calls must be authenticated")
        if not socket_path and not listen:
            raise InvalidRequest("nothing to listen on: give a socket path or --listen")
        self.core = core
        self.endpoints = endpoints
        self.socket_path = socket_path
        # Beside the gRPC socket, a socket for Session streams as frames (see session_socket).
        self.session_socket = f"{socket_path}.session" if socket_path and endpoints.session_socket else None
        self.admin_socket = admin_socket_path(socket_path) if socket_path else None
        self._session_server: SessionSocketServer | None = None
        self.port: int | None = None
        self._max_workers = max_workers
        self.limits = limits
        self.connections = Connections(self.limits.max_connections, self.limits.max_connections_per_uid)
        self._stop = threading.Event()
        self._reap_interval = reap_interval_s
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self._servers: list[grpc.aio.Server] = []
        self.health = _HealthService()
        self._probe_health = _ProbeHealthService()
        self.health_port: int | None = None
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)

    def _sockets(self) -> list[str]:
        return [s for s in (self.socket_path, self.session_socket, self.admin_socket) if s]

    def start(self) -> Daemon:
        for sock in self._sockets():
            _clear_socket_path(Path(sock))
        if self.socket_path and self.endpoints.socket_group is not None:
            os.chown(Path(self.socket_path).parent, -1, self.endpoints.socket_group)
        self._loop_thread.start()
        old = os.umask(0o177)  # every socket is 0600 from the moment it exists, opened up below
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        finally:
            os.umask(old)
        ends = self.endpoints
        for path, group in ((self.socket_path, ends.socket_group), (self.session_socket, ends.socket_group),
                            (self.admin_socket, ends.admin_group)):
            if path:
                _open_up(path, group, 0o600 if path == self.admin_socket and group is None else 0o660)
        self._reaper.start()
        _log.info("crossoverd serving on %s%s%s (policy %s, %d device(s))",
                  " and ".join(where for where in (self.socket_path, self.endpoints.listen) if where),
                  f"; session streams also on {self.session_socket}" if self.session_socket else "",
                  f"; admin calls on {self.admin_socket}" if self.admin_socket else "",
                  self.core.steering.policy_name, len(self.core.inventory.devices))
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
            server = self._grpc_server(pool, interceptors=(Gate(rank_socket_rule(self.admin_socket)),))
            server.add_insecure_port(f"unix://{self.socket_path}")
            await server.start()
            self._servers.append(server)
        if self.admin_socket:
            server = self._grpc_server(pool, interceptors=())
            server.add_insecure_port(f"unix://{self.admin_socket}")
            await server.start()
            self._servers.append(server)
        ends = self.endpoints
        if ends.listen:
            assert ends.token  # __init__ refuses --listen without one
            server = self._grpc_server(pool, interceptors=(Gate(tcp_rule(ends.token, ends.admin_token)),))
            if ends.tls:
                creds = grpc.ssl_server_credentials([(ends.tls[1], ends.tls[0])])
                self.port = server.add_secure_port(ends.listen, creds)
            else:
                self.port = server.add_insecure_port(ends.listen)
            await server.start()
            self._servers.append(server)
        if ends.health_address:
            # Probes carry no token: this server has the health service and nothing else.
            server = grpc.aio.server(maximum_concurrent_rpcs=_PROBE_CALLS, options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._probe_health, server)
            self.health_port = server.add_insecure_port(ends.health_address)
            if not self.health_port:
                raise OSError(f"cannot listen on {ends.health_address} for health checks")
            await server.start()
            self._servers.append(server)
        for service in _HEALTH_SERVICES:
            for servicer in (self.health, self._probe_health):
                await servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

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
            SchedulerService(self.core, self.limits, self.connections, self.session_socket or ""), server)
        pb_grpc.add_AdminServicer_to_server(AdminService(self.core, self.limits, self.connections), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return server

    def stop(self, grace: float = 1.0) -> None:
        """Fail open: release every waiting rank, then stop serving."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            for servicer in (self.health, self._probe_health):
                asyncio.run_coroutine_threadsafe(servicer.enter_graceful_shutdown(), self._loop).result(timeout=2)
        except Exception:  # a loop that never started (a failed start) has nothing to tell
            _log.debug("health status not set to NOT_SERVING", exc_info=True)
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
