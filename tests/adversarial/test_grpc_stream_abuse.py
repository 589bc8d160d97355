"""A gRPC session stream whose client stops reading is dropped, as the session socket drops one.

Before: each heartbeat's answer waited in an unbounded queue behind a write that
flow control held up, for as long as the client kept sending: the daemon's
memory grew with every heartbeat of a client that never read.
"""
from __future__ import annotations

import time

import grpc
import psutil
import pytest
from attack_bed import answers_within, grant_waits, start_victim

from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from testbed.harness.daemon import queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]


def _ranks(d) -> list[dict]:
    return [r for dev in queue_state(d.socket)["devices"] for key in ("holders", "waiting", "others")
            for r in dev.get(key, [])]


def test_a_client_that_never_reads_is_dropped_and_costs_bounded_memory(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--max-events-per-s", "1000000")
    victim = start_victim(d, tmp_path)
    jobs.append(victim)
    ident = RankIdentity(job_id="deaf", job_name="deaf", rank=0, local_rank=0, world_size=1, local_size=1, device=0,
                         pid=1)
    rss0 = psutil.Process(d.pid).memory_info().rss
    with grpc.insecure_channel(f"unix://{d.socket}", options=[("grpc.http2.lookahead_bytes", 0)]) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        reg = stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=ident.to_pb()), timeout=5)
        deadline = time.monotonic() + 40

        def events():
            yield pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id)
            while time.monotonic() < deadline:
                yield pb.RankEvent(kind=pb.HEARTBEAT)  # each answered with an Alive the client never reads

        call = stub.Session(events())  # never iterated: nothing is read
        dropped = None
        while time.monotonic() < deadline:
            if not any(r.get("job_id") == "deaf" for r in _ranks(d)):
                dropped = time.monotonic()
                break
            time.sleep(0.2)
        grown = psutil.Process(d.pid).memory_info().rss - rss0
        call.cancel()
    assert dropped is not None, "a client that never reads kept its session for 40 s"
    assert grown < 200 * 2**20, grown
    assert answers_within(d, 1.0) < 1.0
    assert victim.wait(120) == 0, victim.output()[-3000:]
    assert grant_waits(d, "victim")
    assert "stopped reading" in d.log.read_text()
