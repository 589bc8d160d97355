"""Fuzz tier: hostile input against a live in-process crossoverd.

Hypothesis drives the three ways into one daemon per test: the session socket
(raw frames), the Scheduler service and the Admin service, with malformed and
absurd input, bounded in count and time. Every BATCH examples and at the end
of each test the daemon must still be whole: GetQueue answers, its threads
live, no exception escaped into a log record, out of a thread or out of
`apply_event` (the gRPC stream would otherwise hide one as "stream broken"),
and a well-behaved client registers and is granted its device over both
transports. Every refusal must be a deliberate status, never UNKNOWN or
INTERNAL (an exception nobody mapped) nor a hang.

Counts of inputs sent and statuses seen are logged at INFO when the module
ends, and written as JSON to $CROSSOVER_FUZZ_REPORT when that is set.
CROSSOVER_FUZZ_EXAMPLES changes the number of examples per test (default 250).
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import socket
import struct
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossover.client.session import RankInfo, Session
from crossover.client.settings import PluginSettings
from crossover.daemon import session_stream
from crossover.daemon.api import CrossoverError
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.scheduler import Scheduler
from crossover.daemon.server import Daemon
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos import framing

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(60)]

_log = logging.getLogger(__name__)

EXAMPLES = int(os.environ.get("CROSSOVER_FUZZ_EXAMPLES", "250"))
BATCH = 50  # examples between health checks
MAX_ERROR_CHARS = 1000
HUGE = 100_000
POLICIES = ("exclusive", "crossover", "passthrough")
# Deliberate answers. UNKNOWN / INTERNAL: an exception nobody mapped; CANCELLED / DEADLINE_EXCEEDED: a hang.
ALLOWED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                     "UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"})

FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- strategies ---------------------------------------------------------------------------------

INT32 = st.one_of(st.sampled_from([0, 1, -1, -2, 2, 7, 1 << 20, (1 << 20) + 1, 2**31 - 1, -(2**31)]),
                  st.integers(-(2**31), 2**31 - 1))
INT64 = st.one_of(st.integers(-2, 20), st.sampled_from([2**31, 2**53, 2**53 + 1, 2**63 - 1, -(2**63)]),
                  st.integers(-(2**63), 2**63 - 1))
UINT64 = st.one_of(st.integers(0, 20), st.sampled_from([2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
VERSION = st.one_of(st.just(1), st.just(1), st.sampled_from([0, 2, 2**32 - 1]), st.integers(0, 2**32 - 1))
SECONDS = st.one_of(st.just(0.0), st.floats(0.0, 0.01),
                    st.sampled_from([-0.0, -1.0, 86_400.0, 86_400.001, math.nan, math.inf, -math.inf, 5e-324, 1e308]),
                    st.floats())
# A long string is a character repeated: drawing 100,000 characters one by one would take seconds.
LONG = st.builds(lambda c, n: c * n, st.sampled_from(["x", "\u00e9", "\u4e2d", "\U0001f600", "\x00", "'"]),
                 st.sampled_from([129, 257, 2_000, 20_000, HUGE]))
STRINGS = st.one_of(st.just(""), st.text(max_size=40), LONG)
KINDS = st.one_of(st.sampled_from(sorted(pb.EventKind.values())), st.integers(-(2**31), 2**31 - 1))
VALID_KINDS = st.sampled_from([pb.COMPUTE_REQUEST, pb.COMPUTE_DONE, pb.COMM_BEGIN, pb.COMM_END, pb.HEARTBEAT,
                               pb.LEASE_RELEASED])


def _events(kinds: st.SearchStrategy[int], batch: st.SearchStrategy[list] = st.just([])) -> st.SearchStrategy:
    """RankEvents whose every field may be absurd (`kinds` decides how often the kind itself is)."""
    return st.builds(pb.RankEvent, kind=kinds, session_id=st.one_of(st.just(""), st.text(max_size=20)),
                     iteration=INT64, seq=UINT64, duration_s=SECONDS, turn_base=INT64, comm_begins=st.booleans(),
                     no_wait=st.booleans(), requested=st.booleans(), comm_s=SECONDS, ago_s=SECONDS,
                     yields=st.booleans(), batch=batch)


PLAUSIBLE = _events(VALID_KINDS)
HOSTILE = _events(KINDS)
NESTED = _events(st.sampled_from([pb.BATCH, pb.OPEN, pb.HEARTBEAT]), st.lists(HOSTILE, max_size=3))
BATCH_EVENT = st.builds(lambda evs: pb.RankEvent(kind=pb.BATCH, batch=evs),
                        st.lists(st.one_of(PLAUSIBLE, HOSTILE, NESTED), max_size=6))
BIG_BATCH = st.builds(lambda ev, n: pb.RankEvent(kind=pb.BATCH, batch=[ev] * n), st.one_of(PLAUSIBLE, HOSTILE),
                      st.sampled_from([1_000, 3_000]))
EVENTS = st.one_of(PLAUSIBLE, PLAUSIBLE, HOSTILE, NESTED, BATCH_EVENT, BIG_BATCH)
# How a stream starts: OPEN with a fresh session (most often), someone else's open session, a forged,
# empty or huge id, or no OPEN at all.
OPENINGS = st.sampled_from(["valid", "valid", "valid", "duplicate", "unknown", "empty", "huge", "none"])

# Identities that are absurd throughout, and identities that are nearly right (so some register, and
# collide) with what the daemon does not check (node, pid, job_name up to its limit) left wild.
IDENTITIES = st.one_of(
    st.builds(pb.RankIdentity, job_id=STRINGS, job_name=STRINGS, rank=INT32, local_rank=INT32,
              world_size=INT32, local_size=INT32, node=STRINGS, device=INT32,
              pid=st.one_of(st.just(os.getpid()), INT32)),
    st.builds(lambda job, name, rank, world, node, device, pid: pb.RankIdentity(
        job_id=job, job_name=name, rank=rank, local_rank=rank, world_size=world, local_size=world, node=node,
        device=device, pid=pid),
        st.sampled_from(["j0", "j1", "j2"]), st.one_of(st.text(max_size=20), st.just("n" * 256)), st.integers(0, 3),
        st.integers(1, 4), STRINGS, st.integers(-1, 1), st.one_of(st.just(os.getpid()), st.integers(1, 2**31 - 1))),
)
REGISTERS = st.builds(lambda version, ident, leases: pb.RegisterRequest(
    protocol_version=version, identity=ident, accepts_leases=leases),
    VERSION, st.one_of(st.none(), IDENTITIES), st.booleans())
NAMES = st.one_of(st.sampled_from(POLICIES), STRINGS)
ADMIN_CALLS = st.one_of(
    st.tuples(st.sampled_from(["GetQueue", "Drain", "Resume"]), VERSION, INT32),
    st.tuples(st.sampled_from(["SetPolicy", "GetPolicy"]), VERSION, NAMES),
    st.tuples(st.just("ListJobs"), VERSION, st.none()),
    st.tuples(st.just("TurnFloor"), st.none(), STRINGS),
)
FRAME_KINDS = st.sampled_from(["random_bytes", "oversized_header", "lying_header", "events", "events",
                               "truncated", "garbage_after", "empty"])


# ---- the harness --------------------------------------------------------------------------------


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
        core = Scheduler(inv, "exclusive", node="node-fuzz", event_log=EventLog(), heartbeat_interval_s=0.1,
                         heartbeat_timeout_s=0.8)
        self.daemon = Daemon(core, socket_path=str(sock), reap_interval_s=0.05).start()
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
        return self.sched.Register(pb.RegisterRequest(protocol_version=1, identity=ident, accepts_leases=n % 3 == 0),
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
        self.admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name=data.draw(st.sampled_from(POLICIES))),
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
        q = self.admin.GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=5)
        assert [dev.index for dev in q.devices] == [0, 1]
        # private, but nothing public says whether the loop and the reaper still run
        assert self.daemon._loop_thread.is_alive() and self.daemon._reaper.is_alive()
        self.assert_nothing_escaped()
        self.admin.SetPolicy(pb.PolicyRequest(protocol_version=1, name="exclusive"), timeout=5)
        for device in (0, 1):
            self.admin.Resume(pb.DeviceRequest(protocol_version=1, device=device), timeout=5)
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
        session = Session(RankInfo(job_id=f"id-{job}", job_name=job, rank=0, local_rank=0, world_size=1,
                                   local_size=1, device=0), s).start()
        try:
            assert session.attached, f"a well-behaved client ({transport}) could not attach"
            assert session.transport == ("session socket" if transport == "auto" else "grpc")
            for i in range(3):
                assert session.acquire(i, comm_s=0.001 if i else None) is True, f"{job}: no grant for iteration {i}"
                session.release(i, 0.001, comm_begins=True)
        finally:
            session.close()
        grants = [e for e in self.daemon.core.events.snapshot() if e["event"] == "grant" and e.get("job_name") == job]
        assert len(grants) == 3, grants


@pytest.fixture(scope="module")
def stats() -> Iterator[Stats]:
    """The module's counts: logged at INFO at the end, and written as JSON to $CROSSOVER_FUZZ_REPORT."""
    s = Stats()
    t0 = time.monotonic()
    yield s
    summary = {**s.as_dict(), "seconds": round(time.monotonic() - t0, 2), "examples_per_test": EXAMPLES}
    _log.info("fuzz summary: %s", json.dumps(summary, sort_keys=True))
    if path := os.environ.get("CROSSOVER_FUZZ_REPORT"):
        Path(path).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


@pytest.fixture
def fuzzd(stats: Stats, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fuzzd]:
    """A started daemon, watched for escaped exceptions; stopped at teardown."""
    problems = Problems()
    root = logging.getLogger()
    root.addHandler(problems)
    monkeypatch.setattr(threading, "excepthook", problems.thread_died)
    real_apply = session_stream.apply_event

    def apply_event(*args: Any, **kwargs: Any) -> Any:  # same call, watched: the gRPC stream swallows the rest
        try:
            return real_apply(*args, **kwargs)
        except CrossoverError:
            raise
        except Exception as exc:
            problems.found.append(f"apply_event raised {exc!r} on {str(args[2])[:300]}")
            raise

    monkeypatch.setattr(session_stream, "apply_event", apply_event)
    with tempfile.TemporaryDirectory(prefix="xofz-") as tmp:
        h = Fuzzd(Path(tmp) / "d.sock", stats, problems)
        try:
            yield h
        finally:
            h.close()
            root.removeHandler(problems)


# ---- the tests ----------------------------------------------------------------------------------


def test_the_session_socket_survives_malformed_frames(fuzzd: Fuzzd) -> None:
    """Random bytes, lying or oversized headers, truncated or trailing-garbage frames, hostile events,
    and connections closed abruptly: each ends only its own connection, with a deliberate error."""

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        fuzzd.set_policy(data)
        kind = data.draw(FRAME_KINDS, label="kind")
        holder = None
        if kind == "random_bytes":
            payload = data.draw(st.binary(max_size=2048), label="bytes")
        elif kind == "oversized_header":
            n = data.draw(st.integers(framing.MAX_FRAME + 1, 2**32 - 1), label="length")
            payload = struct.pack(">I", n) + data.draw(st.binary(max_size=64), label="body")
        elif kind == "lying_header":
            n = data.draw(st.integers(0, 4096), label="length")
            payload = struct.pack(">I", n) + data.draw(st.binary(max_size=256), label="body")
        elif kind == "empty":
            payload = b""
        else:
            events, holder = fuzzd.script(data)
            payload = b"".join(framing.encode(e) for e in events)
            if kind == "truncated" and payload:
                payload = payload[:data.draw(st.integers(0, len(payload) - 1), label="cut")]
            elif kind == "garbage_after":
                payload += data.draw(st.binary(min_size=1, max_size=64), label="garbage")
        abrupt = data.draw(st.sampled_from([False, False, False, True]), label="abrupt")
        fuzzd.stats.sent[f"frames.{kind}{'.abrupt' if abrupt else ''}"] += 1
        fuzzd.scripted(holder, lambda: fuzzd.frames(payload, abrupt))

    run()
    fuzzd.check()


def test_register_refuses_absurd_identities_with_deliberate_statuses(fuzzd: Fuzzd) -> None:
    """Huge strings, negative or huge ranks, sizes and devices, absurd pids, any protocol_version."""

    @FUZZ
    @given(request=REGISTERS)
    def run(request: pb.RegisterRequest) -> None:
        fuzzd.stats.sent["grpc.Register"] += 1
        fuzzd.rpc("grpc.Register", lambda: fuzzd.sched.Register(request, timeout=5))
        fuzzd.example()

    run()
    fuzzd.check()


def test_session_streams_of_hostile_events_end_with_deliberate_statuses(fuzzd: Fuzzd) -> None:
    """The gRPC Session stream fed what the session socket test feeds as frames, as whole messages."""

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        fuzzd.set_policy(data)
        events, holder = fuzzd.script(data)
        fuzzd.stats.sent["grpc.Session"] += 1
        fuzzd.scripted(holder, lambda: fuzzd.rpc("grpc.Session",
                                                  lambda: list(fuzzd.sched.Session(iter(events), timeout=10))))

    run()
    fuzzd.check()


def test_admin_calls_with_bad_devices_and_names_get_deliberate_statuses(fuzzd: Fuzzd) -> None:
    """Every Admin call, and TurnFloor, with absurd devices, names, session ids and versions, on the rank
    socket and (where the daemon has one) the admin socket."""
    adm, sch = pb_grpc.AdminStub, pb_grpc.SchedulerStub
    calls: dict[str, Callable[[grpc.Channel, Any, Any], Any]] = {
        "GetQueue": lambda c, v, x: adm(c).GetQueue(pb.QueueRequest(protocol_version=v, device=x), timeout=5),
        "Drain": lambda c, v, x: adm(c).Drain(pb.DeviceRequest(protocol_version=v, device=x), timeout=5),
        "Resume": lambda c, v, x: adm(c).Resume(pb.DeviceRequest(protocol_version=v, device=x), timeout=5),
        "SetPolicy": lambda c, v, x: adm(c).SetPolicy(pb.PolicyRequest(protocol_version=v, name=x), timeout=5),
        "GetPolicy": lambda c, v, x: adm(c).GetPolicy(pb.PolicyRequest(protocol_version=v, name=x), timeout=5),
        "ListJobs": lambda c, v, x: adm(c).ListJobs(pb.JobsRequest(protocol_version=v), timeout=5),
        "TurnFloor": lambda c, v, x: sch(c).TurnFloor(pb.TurnFloorRequest(session_id=x), timeout=5),
    }

    @FUZZ
    @given(call=ADMIN_CALLS, way=st.sampled_from(sorted(fuzzd.ways)))
    def run(call: tuple[str, Any, Any], way: str) -> None:
        name, version, arg = call
        surface = f"grpc.{name}@{way}"
        fuzzd.stats.sent[surface] += 1
        fuzzd.rpc(surface, lambda: calls[name](fuzzd.ways[way], version, arg))
        fuzzd.example()

    run()
    fuzzd.check()


def _huge_calls(fuzzd: Fuzzd, big: str) -> dict[str, Callable[[], Any]]:
    """Each RPC that may quote a client's string back in an error, carrying `big` there."""

    def ident(**kw: Any) -> pb.RankIdentity:
        return pb.RankIdentity(**{"job_id": "j", "job_name": "j", "world_size": 1, "local_size": 1,
                                  "pid": os.getpid(), **kw})

    a, s = fuzzd.admin, fuzzd.sched
    return {
        "SetPolicy name": lambda: a.SetPolicy(pb.PolicyRequest(protocol_version=1, name=big), timeout=5),
        "TurnFloor session_id": lambda: s.TurnFloor(pb.TurnFloorRequest(session_id=big), timeout=5),
        "Session OPEN session_id": lambda: list(s.Session(iter([pb.RankEvent(kind=pb.OPEN, session_id=big)]),
                                                          timeout=5)),
        "Register job_id": lambda: s.Register(pb.RegisterRequest(protocol_version=1, identity=ident(job_id=big)),
                                              timeout=5),
        "Register job_name": lambda: s.Register(pb.RegisterRequest(protocol_version=1,
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


def test_huge_strings_are_refused_and_the_daemon_stays_whole(fuzzd: Fuzzd) -> None:
    """Every huge string is refused with a deliberate status (or, on the session socket, a reply cut
    because it outgrew the socket buffer: the next test's business), and the daemon serves on."""
    answers = _huge_string_sweep(fuzzd)
    assert all(code != "OK" for _, _, code, _ in answers), answers


def test_error_messages_stay_bounded_whatever_the_input(fuzzd: Fuzzd) -> None:
    """A long input must not come back whole (issue 13 item 4): the message is at most MAX_ERROR_CHARS,
    the daemon's own status arrives (not the client's RESOURCE_EXHAUSTED for an oversized trailer), and a
    session socket reply arrives whole (not cut mid-frame because it outgrew the socket buffer)."""
    offenders = [f"{where} ({n} chars sent): {code}, {len(msg)}-char message {msg[:80]!r}"
                 for where, n, code, msg in _huge_string_sweep(fuzzd)
                 if len(msg) > MAX_ERROR_CHARS or code == "TORN_FRAME"
                 or (code == "RESOURCE_EXHAUSTED" and "metadata" in msg)]
    assert not offenders, "\n".join(offenders)
