"""The gRPC edge against a real in-process daemon: session streams, liveness, leases and batches."""
from __future__ import annotations

import logging
import statistics
import threading
import time

import grpc
import pytest

from crossover.client.rank.session import Session
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.event_records import CommBegin, CommEnd, Leave, Request, Suspend
from tests.integration.rpc._world import _END, first_directive, holding_stream, identity, register, rpc_error, wait_for

pytestmark = pytest.mark.timeout(60)


def test_silent_rank_is_suspended_its_grant_goes_to_the_waiter_and_it_is_evicted_later(serve, channels, streams,
                                                                                       sessions):
    d = serve(heartbeat_timeout_s=0.5, evict_after_s=2.5)
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    reg = register(stub, job="silent", world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=41))
    grant = first_directive(call)
    assert grant.WhichOneof("kind") == "grant" and grant.grant.seq == 41
    # from here the silent rank sends nothing: no heartbeat, no release

    waiter = sessions(target, "patient")
    t0 = time.monotonic()
    assert waiter.acquire(0) is True  # blocks until the silent rank is suspended
    waited = time.monotonic() - t0
    assert waited < 1.0, f"grant took {waited:.2f}s to move to the waiting rank"
    # the daemon logs after it sends: the grant may arrive before the log has the suspension
    suspend = wait_for(lambda: [e for e in d.core.events.events()
                                if e.name == "suspend" and e.job_name == "silent"])
    assert "heartbeat" in Suspend.of(suspend[0]).reason and Suspend.of(suspend[0]).phase == "compute"
    silent_rank = [r for r in d.core.steering.snapshot()[1] if r.ident.job_name == "silent"]
    assert [r.phase.value for r in silent_rank] == ["suspended"]
    waiter.release(0)

    first_directive(call, timeout=5.0)  # the stream ends once the silence passes --evict-after
    leave = wait_for(lambda: [e for e in d.core.events.events()
                              if e.name == "leave" and e.job_name == "silent"])
    assert "heartbeat" in Leave.of(leave[0]).reason
    assert time.monotonic() - t0 >= 2.0
    assert not any(r.ident.job_name == "silent" for r in d.core.steering.snapshot()[1])
    # the waiter kept heartbeating through it all and is still registered
    assert any(r.ident.job_name == "patient" for r in d.core.steering.snapshot()[1])


def test_a_starved_rank_that_speaks_again_carries_on_in_its_session(serve, channels, streams, sessions):
    d = serve(heartbeat_timeout_s=0.4, evict_after_s=30.0)
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    holder = sessions(target, "holder")
    assert holder.acquire(0) is True
    reg = register(stub, job="starved", world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=5))
    wait_for(lambda: [e for e in d.core.events.events() if e.name == "suspend"], timeout=3.0)
    holder.release(0)
    time.sleep(0.2)
    assert [e for e in d.core.events.events() if e.name == "grant" and e.job_name == "starved"] == []
    q.put(pb.RankEvent(kind=pb.HEARTBEAT))  # back: its old request is queued again and granted
    grant = first_directive(call)
    assert grant.WhichOneof("kind") == "grant" and grant.grant.seq == 5
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0))
    q.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=1, seq=6))
    assert first_directive(call).grant.seq == 6
    assert [e.name for e in d.core.events.events() if e.job_name == "starved"][:5] == [
        "register", "request", "suspend", "resume", "request"]


def test_stream_end_frees_the_grant(serve, channels, streams, sessions):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    q, call = holding_stream(stub, streams, "quitter")
    waiter = sessions(target, "next-in-line", grant_timeout_s=5.0)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(waiter.acquire(0)), daemon=True)
    t.start()
    wait_for(lambda: d.core.steering.snapshot()[0][0][1])  # device 0 has a waiting rank
    q.put(_END)  # the client half-closes its stream: the daemon must free the grant at once
    t.join(timeout=3)
    assert result == [True]
    waiter.release(0)


def test_policy_switch_reaches_connected_sessions(serve, channels, sessions, caplog):
    d = serve()
    target = f"unix://{d.socket_path}"
    s = sessions(target, "switcher")
    assert s.registration.policy_blocks is True
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    with caplog.at_level(logging.INFO, logger="crossover.client.rank.session"):
        admin.SetPolicy(pb.PolicyRequest(protocol_version=PROTOCOL_VERSION, name="passthrough"), timeout=5)
        wait_for(lambda: "switched policy to passthrough" in caplog.text)
    assert s.acquire(0) is True
    s.release(0)


def test_stopping_the_daemon_releases_waiters(serve, channels, streams, sessions):
    d = serve()
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    q, call = holding_stream(stub, streams, "hog")
    for _ in range(3):  # keep the hog alive while the waiter blocks
        q.put(pb.RankEvent(kind=pb.HEARTBEAT))
    waiter = sessions(target, "blocked", grant_timeout_s=10.0)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(waiter.acquire(0)), daemon=True)
    t.start()
    time.sleep(0.2)
    assert not result
    t0 = time.monotonic()
    d.stop(grace=0.5)
    t.join(timeout=5)
    assert result == [True]  # granted by the shutdown, not timed out
    assert time.monotonic() - t0 < 3


def test_close_delivers_every_event_still_queued(serve, sessions, tmp_path):
    """A short job's last events must reach the daemon when the session closes at exit."""
    d = serve(policy="passthrough")
    s = sessions(f"unix://{tmp_path / 'd.sock'}", "burst")
    assert s.attached
    for i in range(300):  # passthrough: acquire does not wait, so events pile up in the stream
        s.acquire(i)
        s.release(i, 0.001)
    s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        releases = [e for e in d.core.events.events() if e.name == "release" and e.job_name == "burst"]
        if len(releases) == 300:
            break
        time.sleep(0.05)
    assert len(releases) == 300, f"the daemon saw {len(releases)} of 300 compute phases"


def test_a_request_sent_during_comm_carries_the_end_of_the_allreduce(serve, sessions):
    d = serve(policy="exclusive")
    s = sessions(f"unix://{d.socket_path}", "folded")
    assert s.acquire(0) is True
    s.release(0, 0.01, comm_begins=True)  # one message: COMPUTE_DONE that begins the allreduce
    time.sleep(0.3)  # the allreduce: the daemon takes the rank's 0.25 s, which is within what it saw
    assert s.acquire(1, comm_s=0.25) is True  # COMPUTE_REQUEST with the comm length (under the lease it
    s.release(1, 0.01)                        # rides on this COMPUTE_DONE: one message for both)
    kinds = ("comm_begin", "comm_end", "request")
    def folded() -> list[dict] | None:  # iteration 1 may arrive up to CROSSOVER_REPORT_INTERVAL late
        events = [e for e in d.core.events.events() if e.name in kinds and e.job_name == "folded"]
        last = events[-1] if events else None
        return events[-3:] if last is not None and last.name is Request.name and Request.of(last).iteration == 1 \
            else None

    comm_begin, comm_end, request = wait_for(folded)
    assert comm_begin.name is CommBegin.name and CommBegin.of(comm_begin).iteration == 0
    assert comm_end.name is CommEnd.name and CommEnd.of(comm_end) == CommEnd(iteration=0, duration_s=0.25)
    assert request.name is Request.name and Request.of(request).iteration == 1
    rank = next(r for r in d.core.steering.snapshot()[1] if r.ident.job_name == "folded")
    assert rank.mean_comm_s == pytest.approx(0.25)


def test_no_socket_means_no_daemon_at_once_and_a_silent_one_gets_the_connect_timeout(sessions, tmp_path, caplog):
    t0 = time.monotonic()
    s = sessions(f"unix://{tmp_path / 'absent.sock'}", "lonely", connect_timeout_s=30.0)
    assert not s.attached and time.monotonic() - t0 < 1.0
    assert "no daemon socket at" in caplog.text

    import socket as _socket
    silent = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)  # bound and listening, never answering
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(1)
    try:
        t0 = time.monotonic()
        s = sessions(f"unix://{tmp_path / 'silent.sock'}", "patient", connect_timeout_s=0.5)
        assert not s.attached and time.monotonic() - t0 >= 0.5
    finally:
        silent.close()


def test_a_lease_is_revoked_when_a_second_rank_arrives_and_compute_never_overlaps(serve, sessions):
    """A rank computes alone under a lease while other ranks come and go on its device.

    Overlap is observed where it would happen, in the clients: each marks the
    device busy while it "computes", so a grant the daemon gave too early
    shows up as two at once, whatever the event log says. Every arrival
    revokes the lease, every departure lets the lone rank have it again.
    """
    d = serve(policy="exclusive")
    target = f"unix://{d.socket_path}"
    busy, most = [0], [0]
    lock = threading.Lock()
    stop = threading.Event()
    counts: dict[str, int] = {}

    def work(s: Session, name: str, iters: int) -> None:
        counts[name] = 0
        for i in range(iters):
            if stop.is_set():
                return
            assert s.acquire(i, comm_s=0.001 if i else None) is True
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            time.sleep(0.002)
            with lock:
                busy[0] -= 1
            s.release(i, 0.002, comm_begins=True)
            counts[name] += 1
            time.sleep(0.001)  # "allreduce"

    alpha = sessions(target, "alpha")
    ta = threading.Thread(target=work, args=(alpha, "alpha", 100_000), daemon=True)
    ta.start()
    visitors = 12
    for n in range(visitors):
        before = alpha.leased_acquires
        wait_for(lambda b=before: alpha.leased_acquires >= b + 5)  # alone again, and leased
        visitor = sessions(target, f"visitor{n}")
        work(visitor, visitor.info.job_name, 5)
        visitor.close()
    stop.set()
    ta.join(timeout=30)
    assert all(counts[f"visitor{n}"] == 5 for n in range(visitors))
    assert most[0] == 1
    kinds = [e.name for e in d.core.events.events() if e.job_name == "alpha"]
    assert kinds.count("lease") == visitors + 1
    assert kinds.count("lease_revoke") == kinds.count("lease_released") == visitors
    assert "lease_expired" not in kinds


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_rank_knows_whether_it_shares_its_device(serve, sessions, transport):
    d = serve(policy="passthrough")
    target = f"unix://{d.socket_path}"
    alone = sessions(target, "alone", transport=transport)
    wait_for(lambda: alone.attached and not alone.shares_device)
    other_device = sessions(target, "elsewhere", device=1, transport=transport)
    wait_for(lambda: other_device.attached and not other_device.shares_device)
    assert not alone.shares_device
    company = sessions(target, "company", transport=transport)
    wait_for(lambda: company.attached and alone.shares_device and company.shares_device)
    company.close()
    wait_for(lambda: not alone.shares_device)


def test_a_newcomer_is_not_granted_before_the_holder_gives_up_its_lease(serve, channels, streams, sessions):
    """The holder here is driven by hand: it computes under its lease, its request still unsent, and
    answers the revocation late. The newcomer (a real client) must wait for that answer and then
    for the holder's COMPUTE_DONE, not be granted the device that looks idle to the daemon."""
    d = serve(policy="exclusive")
    target = f"unix://{d.socket_path}"
    stub = pb_grpc.SchedulerStub(channels(target))
    reg = stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=identity(job="holder", world=1),
                                           accepts_leases=True), timeout=5)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=1))
    assert first_directive(call).grant.seq == 1
    assert first_directive(call).lease.held is True
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0, comm_begins=True))
    # iteration 1 starts under the lease; nothing is sent yet
    newcomer = sessions(target, "newcomer")
    granted = threading.Event()
    threading.Thread(target=lambda: newcomer.acquire(0) and granted.set(), daemon=True).start()
    assert first_directive(call).lease.held is False
    assert not granted.wait(0.3)  # the daemon sees an idle device, but the holder has not answered
    q.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=1, seq=2, no_wait=True))
    q.put(pb.RankEvent(kind=pb.LEASE_RELEASED))
    assert not granted.wait(0.3)  # now queued behind the holder's compute phase
    q.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=1, comm_begins=True))
    assert granted.wait(5)
    newcomer.release(0)


def test_a_rank_that_does_not_wait_reports_in_dated_batches(serve, sessions):
    d = serve(policy="passthrough")
    s = sessions(f"unix://{d.socket_path}", "batched")
    sent: list[int] = []
    put = s._put
    s._put = lambda event: (sent.append(event.kind), put(event))  # type: ignore[method-assign]
    asked: list[float] = []
    for i in range(12):
        asked.append(time.monotonic())
        assert s.acquire(i, comm_s=0.004 if i else None) is True
        time.sleep(0.02)
        s.release(i, 0.02, comm_begins=True)
        time.sleep(0.004)
    grants = wait_for(lambda: [e for e in d.core.events.events() if e.name == "grant"
                               and e.job_name == "batched"][11:] and
                      [e for e in d.core.events.events() if e.name == "grant" and e.job_name == "batched"])
    assert sent.count(pb.BATCH) <= 6 and pb.COMPUTE_REQUEST not in sent  # 12 iterations, a few messages
    # Dated when they happened, not when their batch arrived (which would put a batch's grants within
    # a millisecond of each other): each grant sits where the rank's own clock put it, measured here so
    # that a loaded machine's longer sleeps count on both sides, to within the few milliseconds a rank's
    # clock reading drifts. The daemon never dates an event before the rank's previous message arrived
    # (no backdating past what it saw), so a message the machine delays moves one date later: that one
    # grant or two may sit late, never early; dated on arrival, most would be late.
    offsets = [g.t - a for g, a in zip(grants, asked)]  # the daemon's clock against this one's
    late = [o - statistics.median(offsets) for o in offsets]
    shown = " ".join(f"{x * 1000:+.1f}ms" for x in late)
    assert all(x > -0.015 for x in late), shown
    assert sum(x >= 0.015 for x in late) <= 2, shown
    assert statistics.median(b.t - a.t for a, b in zip(grants, grants[1:])) > 0.010, shown  # not bunched
    rank = next(r for r in d.core.steering.snapshot()[1] if r.ident.job_name == "batched")
    # The rank's 20 ms where the batch's dates agree; where the dates (ago_s) say less, the daemon's figure.
    assert rank.iteration == 11 and rank.mean_compute_s == pytest.approx(0.02, rel=0.15)


def test_a_batch_may_not_nest_or_open_or_date_into_the_future(serve, channels):
    d = serve()
    stub = pb_grpc.SchedulerStub(channels(f"unix://{d.socket_path}"))
    for inner, words in ((pb.RankEvent(kind=pb.OPEN), "inside a BATCH"),
                         (pb.RankEvent(kind=pb.BATCH), "inside a BATCH"),
                         (pb.RankEvent(kind=pb.HEARTBEAT, ago_s=-1.0), "ago_s")):
        reg = register(stub, job=f"nest{inner.kind}{inner.ago_s}")
        events = [pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), pb.RankEvent(kind=pb.BATCH, batch=[inner])]
        err = rpc_error(lambda ev=events: list(stub.Session(iter(ev), timeout=5)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_a_plugin_of_another_protocol_is_refused_plainly_and_trains_unscheduled(serve, sessions, caplog,
                                                                                 monkeypatch):
    """Daemon and plugin ship together; a mismatched pair (here a protocol-1 plugin, which still sent
    turn_base and called TurnFloor) is told which versions differ at registration, and never waits."""
    import crossover.client.rank.transport as client_transport

    d = serve(policy="exclusive")
    monkeypatch.setattr(client_transport, "PROTOCOL_VERSION", 1)
    with caplog.at_level(logging.WARNING, logger="crossover.client.rank.session"):
        s = sessions(f"unix://{d.socket_path}", "old-plugin")
        wait_for(lambda: "protocol_version=1 is not supported" in caplog.text)
        t0 = time.monotonic()
        assert s.acquire(0) is False  # not attached: the rank trains unscheduled at once
        assert time.monotonic() - t0 < 2.5, "it waited: half its grant timeout (5 s) went by"  # a hang guard
    assert f"it speaks {PROTOCOL_VERSION}" in caplog.text and "upgrade the client or the daemon" in caplog.text
