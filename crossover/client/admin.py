"""A typed client of a daemon's Admin service: what `crossover`, the test beds and the benchmarks call.

`AdminClient` speaks to one crossoverd (its Unix socket, or `host:port` over TCP with a token and
TLS), sends the protocol version and, on a steering call, who asks; it goes to the daemon's admin
socket by itself when it was given the rank-side one. Each call answers with a typed record of
`crossover.client.replies`, never the protobuf itself. A failed call raises one `AdminError`
subclass that says, in one line, what is wrong and what to do: the gRPC status is translated here
and nowhere else.
"""
from __future__ import annotations

import os
import pwd
import socket
import stat
from types import TracebackType
from typing import cast

import grpc

from crossover.client.daemon_socket import channel_for, untrusted_socket
from crossover.client.replies import DeviceAck, EvictReply, JobList, JobState, PolicyInfo, QueueState
from crossover.errors import CrossoverError
from crossover.protos import PROTOCOL_VERSION, STEERING_CALLS, USER_METADATA_KEY, admin_socket_path, switches
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.priority import to_wire
from crossover.settings import PLUGIN_SETTINGS

__all__ = ["AdminClient", "AdminError", "BadSetting", "DaemonUnreachable", "NotAllowed", "RequestRefused",
           "TokenRefused"]


class AdminError(CrossoverError):
    """A call to the daemon's Admin service failed; the message is one line for a person."""


class DaemonUnreachable(AdminError):
    """No daemon answered at the target (not running, stale socket, frozen, filtered)."""


class TokenRefused(AdminError):
    """The daemon refused the token."""


class NotAllowed(AdminError):
    """This user or token may not make the call (a steering call off the admin socket, say)."""


class RequestRefused(AdminError):
    """The daemon answered and rejected the request (unknown device or policy, bad value, ...)."""


class BadSetting(AdminError):
    """The client's own settings are unusable (a CA file it cannot read)."""


def _user() -> str:
    """This process's user name, for the daemon's record of a steering call."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


_WHERE = "set CROSSOVER_SOCKET or pass --socket (or --address HOST:PORT)"


def _socket_problem(path: str) -> str | None:
    """What keeps a client off the Unix socket at `path`, as one line with what to do; None when something
    accepts connections there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"no daemon socket at {path}: crossoverd is not running there; start it, or {_WHERE}"
    except OSError as exc:
        return f"cannot reach {path}: {exc.strerror or exc}; {_WHERE}"
    if stat.S_ISDIR(mode):
        return f"{path} is a folder, not a socket: name the socket in it (crossoverd.sock), or {_WHERE}"
    if not stat.S_ISSOCK(mode):
        return f"{path} is not a socket (a regular file or a device): name crossoverd's socket, or {_WHERE}"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return f"{path} is a stale socket (nobody listens): crossoverd is not running; start it, or {_WHERE}"
    except OSError as exc:
        return f"cannot connect to {path}: {exc.strerror or exc}; {_WHERE}"
    finally:
        probe.close()
    return None


def _unreachable(target: str, code: grpc.StatusCode, timeout: float) -> str:
    """One line: which daemon was tried, what is wrong with it (not running, or answering not at all), what next."""
    if not target.startswith("unix://"):
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"crossoverd at {target} did not answer within {timeout:g} s (frozen, overloaded or filtered)"
        return f"no crossoverd answers at {target} (not running, or unreachable from here); check --address"
    path = target[len("unix://"):]
    return _socket_problem(path) or (
        f"crossoverd at {path} accepts connections but did not answer within {timeout:g} s: it is frozen "
        "(stopped: `ps -o stat` of its pid shows T) or overloaded")


def translate(exc: grpc.RpcError, target: str, timeout: float, method: str = "", command: str = "",
              token_sent: bool = True) -> AdminError:
    """The AdminError a failed call's status stands for. A refusal names the call as `command` (the CLI's
    `crossover priority`) where given, not as its RPC `method`; a token refused says where one comes from."""
    code = exc.code()
    details = exc.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return DaemonUnreachable(_unreachable(target, code, timeout))
    if code is grpc.StatusCode.UNAUTHENTICATED:
        if not token_sent:
            return TokenRefused(f"crossoverd at {target} needs its token: pass --token-file FILE (or set "
                                "CROSSOVER_TOKEN)")
        return TokenRefused(f"crossoverd at {target} refused the token ({details}): pass the daemon's "
                            "--token-file (or its --admin-token-file, to steer)")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        if method and command and details.startswith(method):
            details = f"`{command}`{details[len(method):]}"
        if details.endswith("needs the admin token"):  # over TCP: where that token comes from
            details += ": pass --token-file with the daemon's --admin-token-file"
        return NotAllowed(f"not allowed: {details}")
    return RequestRefused(f"{details} ({code.name})")


class AdminClient:
    """One daemon's Admin service. Give `socket` (a Unix socket path) or `address` (`host:port`).

    Steering calls (policy, drain, resume, priorities, evict) made through a daemon's rank-side
    socket go to its admin socket beside it (`NotAllowed` when this user may not open it).
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, address: str | None = None, *,
                 token: str = "", tls_ca: str = "", timeout: float = 3.0, command: str = "") -> None:
        """`command`: what a refusal calls the request (the CLI gives `crossover drain`); default: its RPC."""
        if not socket and not address:
            raise ValueError("AdminClient needs a socket path or an address")
        # absolute: gRPC reads `unix://dir/x.sock` as a host `dir`, and a refusal names the path it means
        self.socket = None if address or not socket else os.path.abspath(os.fspath(socket))
        self.target = address or f"unix://{self.socket}"
        self.token, self.tls_ca, self.timeout, self.command = token, tls_ca, timeout, command
        self._channel: grpc.Channel | None = None
        self._metadata: list[tuple[str, str]] = []

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def call(self, method: str, request: object) -> object:
        """One Admin call by its RPC name, answered with the daemon's protobuf reply; `AdminError` when it fails.
        The methods below call it and give the reply as its record (`crossover.client.replies`)."""
        if method in STEERING_CALLS and self.socket is not None:
            self._use_admin_socket(method)
        if self._channel is None:
            untrusted = untrusted_socket(self.target, PLUGIN_SETTINGS["CROSSOVER_DAEMON_USER"].read())
            if untrusted:
                raise NotAllowed(untrusted)
            try:
                self._channel, self._metadata = channel_for(self.target, self.token, self.tls_ca)
            except OSError as exc:
                raise BadSetting(f"cannot read --tls-ca {self.tls_ca}: {exc.strerror}") from None
        metadata = list(self._metadata)
        if method in STEERING_CALLS:
            metadata.append((USER_METADATA_KEY, _user()))
        try:
            return getattr(pb_grpc.AdminStub(self._channel), method)(request, timeout=self.timeout,
                                                                      metadata=metadata)
        except grpc.RpcError as exc:
            raise translate(exc, self.target, self.timeout, method, self.command, bool(self.token)) from None

    def _use_admin_socket(self, method: str) -> None:
        """Steer through the admin socket beside the rank socket; `NotAllowed` where this user may not open
        it, or where it is not there although the daemon runs (a container given the rank socket alone)."""
        assert self.socket is not None
        path = admin_socket_path(self.socket)
        if self.target == f"unix://{path}":
            return
        what = f"`{self.command}`" if self.command else method
        if not os.path.exists(path):
            if _socket_problem(self.socket) is None:
                raise NotAllowed(f"{what} needs the daemon's admin socket {path}, which is not there: crossoverd "
                                 f"runs at {self.socket}, but its admin socket is not reachable from here (mount "
                                 f"the folder {os.path.dirname(path) or '.'}, not the socket alone, or run it on "
                                 "the node as the daemon's user)")
            return  # no daemon there: the call fails on the rank socket and says why
        if not os.access(path, os.R_OK | os.W_OK):
            raise NotAllowed(f"{what} needs the daemon's admin socket {path}, which this user may not open "
                             "(it belongs to the daemon's user, or to crossoverd --admin-group)")
        self.close()
        self.target = f"unix://{path}"

    def queue(self, device: int = -1) -> QueueState:
        """Every device's queue (or one device's)."""
        reply = self.call("GetQueue", pb.QueueRequest(protocol_version=PROTOCOL_VERSION, device=device))
        return QueueState.from_pb(cast(pb.QueueState, reply))

    def jobs(self) -> JobList:
        """The jobs with ranks on this node."""
        reply = self.call("ListJobs", pb.JobsRequest(protocol_version=PROTOCOL_VERSION))
        return JobList.from_pb(cast(pb.JobList, reply))

    def policy(self) -> PolicyInfo:
        reply = self.call("GetPolicy", pb.PolicyRequest(protocol_version=PROTOCOL_VERSION))
        return PolicyInfo.from_pb(cast(pb.PolicyInfo, reply))

    def set_policy(self, name: str = "", *, adapt: bool | None = None, handover: bool | None = None,
                   protect: float | None = None) -> PolicyInfo:
        """Switch the policy to `name` ("" keeps it), turn adapting or hand-over on or off, and set the isolation
        target `protect` (each None: as is)."""
        req = pb.PolicyRequest(protocol_version=PROTOCOL_VERSION, name=name, adapt=switches.to_wire(adapt),
                               handover=switches.to_wire(handover),
                               **({"protect": protect} if protect is not None else {}))
        return PolicyInfo.from_pb(cast(pb.PolicyInfo, self.call("SetPolicy", req)))

    def drain(self, device: int) -> DeviceAck:
        reply = self.call("Drain", pb.DeviceRequest(protocol_version=PROTOCOL_VERSION, device=device))
        return DeviceAck.from_pb(cast(pb.DeviceAck, reply))

    def resume(self, device: int) -> DeviceAck:
        reply = self.call("Resume", pb.DeviceRequest(protocol_version=PROTOCOL_VERSION, device=device))
        return DeviceAck.from_pb(cast(pb.DeviceAck, reply))

    def set_job_class(self, job: str, priority: str | None = None, weight: float | None = None) -> JobState:
        """Set a job's priority class (`high`, `normal`, `low`; None keeps it) and weight (None keeps it)."""
        req = pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job=job, weight=weight or 0.0,
                                 **({"priority": to_wire(priority)} if priority else {}))
        return JobState.from_pb(cast(pb.JobState, self.call("SetJobClass", req)))

    def evict(self, device: int | None = None, job: str = "") -> EvictReply:
        """Take a device back from its holder, and/or close every session of a job."""
        req = pb.EvictRequest(protocol_version=PROTOCOL_VERSION, device=-1 if device is None else device, job=job)
        return EvictReply.from_pb(cast(pb.EvictReply, self.call("Evict", req)))
