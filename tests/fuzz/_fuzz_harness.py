"""The fuzz tier's harness: a daemon watched for escaped exceptions (`Fuzzd`) and its counts (`Stats`).

The fixtures built on them (`stats`, `fuzzd`) are in this folder's `conftest.py`."""
from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
from hypothesis import strategies as st

from crossover.client.rank.session import Session
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.daemon.server import Daemon, Endpoints
from crossover.protos import PROTOCOL_VERSION as VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos import framing
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings
from tests.fuzz._fuzz_strategies import ALLOWED, BATCH, EVENTS, HUGE, LONG, OPENINGS, POLICIES


@dataclass
class Stats:
    """What the module sent and got back, for the summary."""

    sent: Counter = field(default_factory=Counter)
    statuses: defaultdict = field(default_factory=lambda: defaultdict(Counter))  # surface -> code -> n
    longest_error: Counter = field(default_factory=Counter)  # surface -> longest message seen
    checks: int = 0

    def status(self, surface: str, code: str, message: str = "") -> None:
        self.statuses[surface][code] += 1
        self.longest_error[surface] = max(self.longest_error[surface], len(message))

    def as_dict(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "statuses": {k: dict(v) for k, v in self.statuses.items()},
                "longest_error": dict(self.longest_error), "health_checks": self.checks}


class Problems(logging.Handler):
    """Collects what must never happen: a record at ERROR or carrying a traceback, an exception out of a
    thread, an exception other than the domain's own out of `apply_event`. Plain warnings are deliberate."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)[-1500:] if record.exc_info else ""
            self.found.append(f"{record.name} {record.levelname}: {record.getMessage()[:300]}\n{trace}")

    def thread_died(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread else "?"
        self.found.append(f"thread {name} died: {args.exc_type.__name__}: {str(args.exc_value)[:300]}")


class Fuzzd:
    """One live daemon on a short temp path (AF_UNIX paths are limited to 108 bytes), its stubs, and the checks."""

    def __init__(self, sock: Path, stats: Stats, problems: Problems) -> None:
        inv = Inventory([Device(0, "cpu", "cpu0", (0,)), Device(1, "cpu", "cpu1", (1,))])
        settings = SchedulerSettings(policy="exclusive", node="node-fuzz", heartbeat_interval_s=0.1,
                                     liveness=LivenessSettings(heartbeat_timeout_s=0.8), adapt=False)
        core = Scheduler(inv, settings, event_log=EventLog())
        self.daemon = Daemon(core, Endpoints(socket_path=str(sock)), reap_interval_s=0.05).start()
        assert self.daemon.session_socket, "the daemon offers no session socket"
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        self.sched = pb_grpc.SchedulerStub(self.channel)
        # A daemon with an admin socket takes the calls that change state there only; an older one, anywhere.
        admin_socket = getattr(self.daemon, "admin_socket", None)
        self.admin_channel = grpc.insecure_channel(f"unix://{admin_socket}") if admin_socket else self.channel
        self.admin = pb_grpc.AdminStub(self.admin_channel)
        self.ways = {"rank": self.channel, "admin": self.admin_channel} if admin_socket else {"rank": self.channel}
        self.stats, self.problems = stats, problems
        self._examples = 0
        self._ids = itertools.count()

    def close(self) -> None:
        self.channel.close()
        self.admin_channel.close()
        self.daemon.stop(grace=0.5)

    # -- sending

    def rpc(self, surface: str, call: Callable[[], Any]) -> tuple[str, str]:
        """Make one gRPC call; record its status and insist it is a deliberate one. (code name, details)"""
        try:
            call()
            code, details = "OK", ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
        self.stats.status(surface, code, details)
        assert code in ALLOWED, f"{surface} answered {code}: {details[:500]}"
        return code, details

    def register(self) -> str:
        """A fresh 1-rank job's session id, for a stream that opens properly."""
        n = next(self._ids)
        ident = pb.RankIdentity(job_id=f"fuzz-{n}", job_name=f"fuzz-{n}", rank=0, local_rank=0, world_size=1,
                                local_size=1, device=n % 2, pid=os.getpid())
        return self.sched.Register(pb.RegisterRequest(protocol_version=VERSION, identity=ident,
                                                      accepts_leases=n % 3 == 0),
                                   timeout=5).session_id

    def connect(self) -> socket.socket:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(5)
        c.connect(str(self.daemon.session_socket))
        return c

    def hold(self, sid: str) -> socket.socket:
        """A session socket stream that opened `sid` and is attached (its heartbeat was answered)."""
        c = self.connect()
        c.sendall(framing.encode(pb.RankEvent(kind=pb.OPEN, session_id=sid))
                  + framing.encode(pb.RankEvent(kind=pb.HEARTBEAT)))
        reader = framing.FrameReader(c.recv)
        while (d := reader.next_message(pb.Directive)) is not None and not d.HasField("alive"):
            assert not d.HasField("error"), d.error
        return c

    def frames(self, data: bytes, abrupt: bool) -> None:
        """Send raw bytes on the session socket. Abrupt: close at once. Otherwise half-close, read what the
        daemon sends until it hangs up, and record the error it ended the connection with."""
        c = self.connect()
        try:
            try:
                c.sendall(data)
                if abrupt:
                    return
                c.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):  # it hung up early (an oversized header, say)
                self.stats.sent["frames.hung_up_mid_send"] += 1
            got, torn = self.replies(c)
        finally:
            c.close()
        assert not torn, f"the daemon's last frame was cut: {torn}"
        errors = [d.error for d in got if d.HasField("error")]
        for e in errors:
            self.stats.status("frames", e.code, e.message)
            assert e.code in ALLOWED - {"OK"}, f"session socket error {e.code}: {e.message[:500]}"
        if not errors:
            self.stats.status("frames", "OK")

    def replies(self, c: socket.socket) -> tuple[list[pb.Directive], str]:
        """Every directive the daemon sends on `c` until it hangs up, which it must do within 5 s, and how
        its last frame was cut ("" when whole: the daemon never sends part of a frame)."""
        buf = bytearray()
        try:
            while chunk := c.recv(65536):
                buf += chunk
        except ConnectionResetError:  # dropped with our bytes unread: what it sent last may be lost
            self.stats.sent["frames.reset_by_daemon"] += 1
        except TimeoutError:
            raise AssertionError("the daemon neither ended nor answered the connection within 5 s") from None
        out: list[pb.Directive] = []
        at = 0
        while at < len(buf):
            if len(buf) - at < framing.HEADER:
                return out, f"{len(buf) - at}-byte header"
            n = struct.unpack_from(">I", buf, at)[0]
            if len(buf) - at - framing.HEADER < n:
                return out, f"{len(buf) - at - framing.HEADER} of {n} bytes"
            out.append(pb.Directive.FromString(bytes(buf[at + framing.HEADER:at + framing.HEADER + n])))
            at += framing.HEADER + n
        return out, ""

    def script(self, data: st.DataObject) -> tuple[list[pb.RankEvent], socket.socket | None]:
        """A stream's events, drawn: an opening (see OPENINGS), then up to 6 events. For a duplicate opening,
        also the connection that holds the session open (close it after use)."""
        opening = data.draw(OPENINGS, label="opening")
        holder = None
        if opening in ("valid", "duplicate"):
            sid = self.register()
            if opening == "duplicate":
                holder = self.hold(sid)
            first = pb.RankEvent(kind=pb.OPEN, session_id=sid)
        elif opening == "unknown":
            first = pb.RankEvent(kind=pb.OPEN, session_id=data.draw(st.text(min_size=1, max_size=64), label="sid"))
        elif opening == "huge":
            first = pb.RankEvent(kind=pb.OPEN, session_id=data.draw(LONG, label="sid"))
        elif opening == "empty":
            first = pb.RankEvent(kind=pb.OPEN)
        else:
            first = data.draw(EVENTS, label="first")
        self.stats.sent[f"opening.{opening}"] += 1
        return [first, *data.draw(st.lists(EVENTS, max_size=6), label="events")], holder

    def set_policy(self, data: st.DataObject) -> None:
        """Fuzzed streams meet every policy's code, not only the default one's."""
        self.admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name=data.draw(st.sampled_from(POLICIES))),
                             timeout=5)

    def example(self) -> None:
        """Count one example; every BATCH of them, check the daemon is whole."""
        self._examples += 1
        if self._examples % BATCH == 0:
            self.check()

    def scripted(self, holder: socket.socket | None, send: Callable[[], None]) -> None:
        """Send one scripted example, close the connection holding its session whatever happens, count it."""
        try:
            send()
        finally:
            if holder is not None:
                holder.close()
        self.example()

    # -- checks

    def check(self) -> None:
        """The daemon is whole: it answers, its threads live, nothing escaped, and a well-behaved client
        is served over either transport (after the operator state a batch may have changed is restored)."""
        q = self.admin.GetQueue(pb.QueueRequest(protocol_version=VERSION, device=-1), timeout=5)
        assert [dev.index for dev in q.devices] == [0, 1]
        # private, but nothing public says whether the loop and the reaper still run
        assert self.daemon._loop_thread.is_alive() and self.daemon._reaper.is_alive()
        self.assert_nothing_escaped()
        self.admin.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name="exclusive"), timeout=5)
        for device in (0, 1):
            self.admin.Resume(pb.DeviceRequest(protocol_version=VERSION, device=device), timeout=5)
        for transport in ("auto", "grpc"):
            self.good_client(transport)
        self.assert_nothing_escaped()
        self.stats.checks += 1

    def assert_nothing_escaped(self) -> None:
        assert not self.problems.found, "\n---\n".join(self.problems.found[:5])

    def good_client(self, transport: str) -> None:
        """A real client without leases registers and is granted each of 3 iterations (the event log agrees)."""
        job = f"good-{next(self._ids)}"
        s = PluginSettings(target=f"unix://{self.daemon.socket_path}", job_name=job, device=0, grant_timeout_s=5.0,
                           connect_timeout_s=2.0, reconnect_interval_s=30.0, pin=False, lease=False,
                           transport=transport)
        session = Session(RankIdentity(job_id=f"id-{job}", job_name=job, rank=0, local_rank=0, world_size=1,
                                       local_size=1, device=0), s).start()
        try:
            assert session.attached, f"a well-behaved client ({transport}) could not attach"
            assert session.transport == ("session socket" if transport == "auto" else "grpc")
            for i in range(3):
                assert session.acquire(i, comm_s=0.001 if i else None) is True, f"{job}: no grant for iteration {i}"
                session.release(i, 0.001, comm_begins=True)
        finally:
            session.close()
        grants = [e for e in self.daemon.core.events.events() if e.name == "grant" and e.job_name == job]
        assert len(grants) == 3, grants


def _huge_calls(fuzzd: Fuzzd, big: str) -> dict[str, Callable[[], Any]]:
    """Each RPC that may quote a client's string back in an error, carrying `big` there."""

    def ident(**kw: Any) -> pb.RankIdentity:
        return pb.RankIdentity(**{"job_id": "j", "job_name": "j", "world_size": 1, "local_size": 1,
                                  "pid": os.getpid(), **kw})

    a, s = fuzzd.admin, fuzzd.sched
    return {
        "SetPolicy name": lambda: a.SetPolicy(pb.PolicyRequest(protocol_version=VERSION, name=big), timeout=5),
        "Session OPEN session_id": lambda: list(s.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id=big)]),
                                                          timeout=5)),
        "Register job_id": lambda: s.Register(pb.RegisterRequest(protocol_version=VERSION, identity=ident(job_id=big)),
                                              timeout=5),
        "Register job_name": lambda: s.Register(pb.RegisterRequest(protocol_version=VERSION,
                                                                   identity=ident(job_name=big)), timeout=5),
    }


def _huge_string_sweep(fuzzd: Fuzzd) -> list[tuple[str, int, str, str]]:
    """Each place a client's string may come back in an error, fed 2,000 ASCII characters and 100,000 emoji
    (400 KB in UTF-8, more than a socket buffer): (where, length sent, code, message). Statuses must be
    deliberate; the daemon must stay whole."""
    out = []
    for char, n in (("x", 2_000), ("\U0001f600", HUGE)):
        big = char * n
        for where, call in _huge_calls(fuzzd, big).items():
            fuzzd.stats.sent[f"huge.{where}"] += 1
            out.append((where, n, *fuzzd.rpc(f"huge.{where}", call)))
        c = fuzzd.connect()
        try:
            c.sendall(framing.encode(pb.RankEvent(kind=pb.OPEN, session_id=big)))
            got, torn = fuzzd.replies(c)
        finally:
            c.close()
        where = "frames OPEN session_id"
        fuzzd.stats.sent[f"huge.{where}"] += 1
        if torn:  # a reply longer than the socket buffer, cut: not a deliberate answer either
            fuzzd.stats.status(f"huge.{where}", "TORN_FRAME")
            out.append((where, n, "TORN_FRAME", f"reply cut after {torn}"))
            continue
        errors = [d.error for d in got if d.HasField("error")]
        assert errors and errors[0].code in ALLOWED - {"OK"}, got
        fuzzd.stats.status(f"huge.{where}", errors[0].code, errors[0].message)
        out.append((where, n, errors[0].code, errors[0].message))
    fuzzd.check()
    return out
