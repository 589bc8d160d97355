"""A flood of registrations is bounded: the daemon holds at most twice --max-connections registered ranks.

Before: Register was counted against no cap, and each one sends a share update
to every session on its device under the scheduler's lock, so a client could
register ranks without end (each unattached one lives 5 s) and make every
registration cost more. Now one past the cap is refused with RESOURCE_EXHAUSTED.
Bounded, not refused: over gRPC the daemon cannot tell one local user's
registrations from another's, so while a flood fills the cap a new rank is
refused too (and trains unscheduled, retrying every 2 s); ranks already
registered, like the victim here, keep their grants.
"""
from __future__ import annotations

import os
import time

import grpc
import pytest
from attack_bed import answers_within, grant_waits, start_victim, stop_after_grants

from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from testbed.harness.daemon import queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]


def test_registrations_past_the_cap_are_refused_and_the_victim_keeps_its_grants(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--max-connections", "32")
    victim = start_victim(d, tmp_path, iters="3000")
    jobs.append(victim)
    deadline = time.monotonic() + 60
    while not grant_waits(d, "victim"):
        assert time.monotonic() < deadline and victim.proc.poll() is None, victim.output()[-3000:]
        time.sleep(0.1)
    accepted, refused, slowest = 0, 0, 0.0
    with grpc.insecure_channel(f"unix://{d.socket}") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        for i in range(400):
            ident = RankIdentity(job_id=f"flood{i}", job_name="flood", rank=0, local_rank=0, world_size=1,
                                 local_size=1, device=0, pid=os.getpid())
            try:
                stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=ident.to_pb()),
                              timeout=5)
                accepted += 1
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                refused += 1
            if i % 50 == 0:
                slowest = max(slowest, answers_within(d, 1.0))
    assert accepted <= 64 - 2 and refused >= 400 - 64, (accepted, refused)
    assert slowest < 1.0
    assert len(queue_state(d.socket)["devices"][0]["others"]) <= 64
    stop_after_grants(d, victim, 220)
    assert victim.wait(150) == 0, victim.output()[-3000:]
    waits = grant_waits(d, "victim")
    assert len(waits) > 200 and max(waits) < 2.0, (len(waits), max(waits))
