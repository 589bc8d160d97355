"""Priority classes through a real in-process daemon and real client sessions: who may raise a class, the
operator's call, and the yield a high rank's request asks of a low holder."""
from __future__ import annotations

import logging
import os
import threading

import grpc
import pytest

from crossover.client.rank.session import Session
from crossover.daemon.class_rules import ClassRules, parse_rule
from crossover.daemon.policies.classes import ClassSettings
from crossover.daemon.policies.isolation import IsolationSettings
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from tests.integration.rpc._world import rpc_error, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ranks(sessions):
    """`make(target, job, priority="")` → an attached session of a one-rank job that asks for `priority`."""
    def make(target: str, job: str, priority: str = "") -> Session:
        s = sessions(target, job, priority=priority, lease=False)
        wait_for(lambda: s.attached)
        return s

    return make


def _jobs(admin: pb_grpc.AdminStub) -> dict[str, pb.JobState]:
    return {j.job_name: j for j in admin.ListJobs(pb.JobsRequest(protocol_version=PROTOCOL_VERSION), timeout=5).jobs}


def test_a_rank_asking_above_its_class_is_refused_in_one_line_and_trains_at_its_own(serve, channels, ranks, caplog):
    d = serve(policy="crossover")
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    with caplog.at_level(logging.WARNING, logger="crossover.client.rank.session"):
        s = ranks(f"unix://{d.socket_path}", "eager", priority="high")
        wait_for(lambda: [r for r in caplog.records if "refused" in r.getMessage()])
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "CROSSOVER_PRIORITY=high refused" in refusals[0] and "normal" in refusals[0]
    assert _jobs(admin)["eager"].priority == pb.PRIORITY_NORMAL
    assert s.acquire(0) is True  # it trains, at its own class


def test_a_rule_for_the_ranks_user_gives_the_class_it_asks_and_a_rank_may_lower_its_own(serve, channels, ranks):
    rules = ClassRules((parse_rule(f"uid:{os.getuid()}=high"),))
    d = serve(policy="crossover", class_rules=rules)
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    ranks(f"unix://{d.socket_path}", "prod")
    ranks(f"unix://{d.socket_path}", "sweep", priority="low")
    wait_for(lambda: _jobs(admin)["prod"].priority == pb.PRIORITY_HIGH)
    jobs = _jobs(admin)
    assert jobs["prod"].class_set_by == f"uid:{os.getuid()}=high"
    assert jobs["sweep"].priority == pb.PRIORITY_LOW and jobs["sweep"].class_set_by == "rank"


def test_the_operator_sets_a_class_and_a_low_holder_yields_to_a_high_request(serve, channels, ranks):
    # The yield on demand alone (--protect 0): with the controller, the idle high job's first solo windows
    # would keep the low job from holding the device at all.
    d = serve(policy="crossover", classes=ClassSettings(isolation=IsolationSettings(target=0.0)))
    target = f"unix://{d.socket_path}"
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    low, high = ranks(target, "sweep"), ranks(target, "prod")
    reply = admin.SetJobClass(pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="prod",
                                                 priority=pb.PRIORITY_HIGH), timeout=5)
    assert reply.job_id == "id-prod" and reply.priority == pb.PRIORITY_HIGH
    admin.SetJobClass(pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="sweep", weight=2.0), timeout=5)
    assert _jobs(admin)["sweep"].weight == 2.0 and _jobs(admin)["prod"].class_set_by == "operator"
    wait_for(lambda: high.job_class == ("high", 1.0))
    wait_for(lambda: low.outranked)  # so a low rank on a GPU keeps little work queued ahead of it
    assert not high.outranked

    assert low.acquire(0) is True  # the low job holds the device
    granted = threading.Event()
    waiter = threading.Thread(target=lambda: granted.set() if high.acquire(0) else None, daemon=True)
    waiter.start()
    wait_for(lambda: low.preempted)  # the daemon asks the low holder to yield
    assert not granted.is_set()
    assert low.take_preempted() and not low.take_preempted()
    low.release(0, 0.01, yields=True)  # what the plugin does at its next gradient
    assert granted.wait(5)
    waiter.join(5)
    events = [e.name for e in d.core.events.events() if e.name in ("preempt", "job_class")]
    assert "preempt" in events and "job_class" in events
    set_by = [e for e in d.core.events.events() if e.name == "job_class_set"]
    assert {e.job for e in set_by} == {"id-prod", "id-sweep"}


def test_the_operator_call_refuses_what_it_cannot_do(serve, channels, ranks):
    d = serve(policy="crossover")
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    ranks(f"unix://{d.socket_path}", "prod")
    for req, code, words in (
        (pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="nobody", priority=pb.PRIORITY_HIGH),
         grpc.StatusCode.NOT_FOUND, "crossover jobs"),
        (pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="prod"), grpc.StatusCode.INVALID_ARGUMENT,
         "priority, a weight"),
        (pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="prod", weight=500),
         grpc.StatusCode.INVALID_ARGUMENT, "0.01..100"),
    ):
        err = rpc_error(admin.SetJobClass, req, timeout=5)
        assert err.code() is code and words in err.details(), err.details()
    rank_side = pb_grpc.AdminStub(channels(f"unix://{d.socket_path}"))
    err = rpc_error(rank_side.SetJobClass, pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="prod",
                                                              priority=pb.PRIORITY_HIGH), timeout=5)
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED  # a rank cannot raise its own job
