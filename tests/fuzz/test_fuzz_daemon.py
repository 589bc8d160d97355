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

import struct
from typing import Any, Callable

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos import framing
from tests.fuzz._fuzz_harness import Fuzzd, _huge_string_sweep
from tests.fuzz._fuzz_strategies import ADMIN_CALLS, FRAME_KINDS, FUZZ, MAX_ERROR_CHARS, REGISTERS

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(60)]


# ---- strategies ---------------------------------------------------------------------------------


# ---- the harness --------------------------------------------------------------------------------


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
                # a share, not an index: the daemon's session ids differ in length between runs
                share = data.draw(st.integers(0, 2**16 - 1), label="cut")
                payload = payload[:share * len(payload) // 2**16]
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
    """Every Admin call with absurd devices, names, session ids and versions, on the rank
    socket and (where the daemon has one) the admin socket."""
    adm = pb_grpc.AdminStub
    calls: dict[str, Callable[[grpc.Channel, Any, Any], Any]] = {
        "GetQueue": lambda c, v, x: adm(c).GetQueue(pb.QueueRequest(protocol_version=v, device=x), timeout=5),
        "Drain": lambda c, v, x: adm(c).Drain(pb.DeviceRequest(protocol_version=v, device=x), timeout=5),
        "Resume": lambda c, v, x: adm(c).Resume(pb.DeviceRequest(protocol_version=v, device=x), timeout=5),
        "SetPolicy": lambda c, v, x: adm(c).SetPolicy(pb.PolicyRequest(protocol_version=v, name=x), timeout=5),
        "GetPolicy": lambda c, v, x: adm(c).GetPolicy(pb.PolicyRequest(protocol_version=v, name=x), timeout=5),
        "ListJobs": lambda c, v, x: adm(c).ListJobs(pb.JobsRequest(protocol_version=v), timeout=5),
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
