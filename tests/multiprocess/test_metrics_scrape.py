"""A live crossoverd's Prometheus metrics and health service, while two real horovodrun jobs share it."""
from __future__ import annotations

import os
import socket
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from crossover.protos import admin_socket_path
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from testbed.harness.jobs import horovodrun, with_import

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a scrape, by sample name: [(labels, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _by_job(samples: dict, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        totals[labels["job_name"]] = totals.get(labels["job_name"], 0.0) + value
    return totals


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


def test_a_scrape_during_two_jobs_shows_what_the_daemon_does(daemon_factory, jobs, tmp_path):
    metrics_port, health_port = _free_port(), _free_port()
    d = daemon_factory("--cpu-devices", "2", "--policy", "crossover", "--metrics-address", f"127.0.0.1:{metrics_port}",
                       "--health-address", f"127.0.0.1:{health_port}")
    assert _health(f"127.0.0.1:{health_port}") == health_pb2.HealthCheckResponse.SERVING
    assert _health(f"unix://{d.socket}", "crossover.v1.Scheduler") == health_pb2.HealthCheckResponse.SERVING

    idle = _scrape(metrics_port)
    assert idle["crossover_jobs"] == [({}, 0.0)]
    assert [v for _l, v in idle["crossover_device_ranks"]] == [0.0, 0.0]
    assert idle["crossover_daemon_info"][0][0]["policy"] == "crossover"
    assert idle["process_resident_memory_bytes"][0][1] > 0

    with grpc.insecure_channel(f"unix://{admin_socket_path(str(d.socket))}") as ch:  # a refused call is counted
        with pytest.raises(grpc.RpcError):
            pb_grpc.AdminStub(ch).GetQueue(pb.QueueRequest(protocol_version=0, device=-1), timeout=5)

    script = with_import(tmp_path)
    env = {"CROSSOVER_SOCKET": str(d.socket)}
    for name in ("alpha", "beta"):
        # Both run until the scrapes below have seen them together for 2 s, then stop.
        jobs.append(horovodrun(name, script, tmp_path, np=2, args=("--iters", "5000"), env=env, stoppable=True))

    both, later, after = None, None, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs):
        s = _scrape(metrics_port)
        grants = _by_job(s, "crossover_grants_total")
        if both is None and s["crossover_jobs"][0][1] == 2 and min(grants.get("alpha", 0), grants.get("beta", 0)) > 5:
            both, t_both = s, time.monotonic()
        elif both is not None and time.monotonic() - t_both > 2:
            later, after = s, _scrape(metrics_port)
            break
        time.sleep(0.2)
    assert both is not None and later is not None, f"never saw both jobs run for 2 s: {jobs[0].output()[-2000:]}"
    for j in jobs:
        j.stop()

    assert sum(v for _l, v in both["crossover_device_ranks"]) == 4
    me = str(os.geteuid())  # the ranks' user, as the kernel names their session socket connections
    assert {labels["uid"]: v for labels, v in both["crossover_sessions"]} == {me: 4}
    assert both["crossover_session_streams"] == [({}, 4.0)]
    assert {labels["uid"]: v for labels, v in both["crossover_session_socket_streams"]} == {me: 4}
    assert all(v in (0.0, 1.0) for _l, v in both["crossover_device_busy"])
    assert all(v >= 0 for _l, v in both["crossover_device_queue_length"])
    assert {labels["job_name"] for labels, _v in both.get("crossover_device_holder", [])} <= {"alpha", "beta"}
    for job in ("alpha", "beta"):  # counters move, and the histograms count what the counters count
        assert _by_job(later, "crossover_grants_total")[job] > _by_job(both, "crossover_grants_total")[job]
        # A scrape reads one family after another while grants go on, the counter first (it is registered first):
        # so within one scrape the histogram counts at least the counter's grants, and no more than the next has.
        waits = _by_job(later, "crossover_grant_wait_seconds_count")[job]
        assert _by_job(later, "crossover_grants_total")[job] <= waits <= _by_job(after, "crossover_grants_total")[job]
        assert _by_job(later, "crossover_compute_seconds_count")[job] > 0
        assert _by_job(later, "crossover_comm_seconds_count")[job] > 0
        mean_compute = _by_job(later, "crossover_compute_seconds_sum")[job] / _by_job(
            later, "crossover_compute_seconds_count")[job]
        assert 0 < mean_compute < 5
    assert later["crossover_event_log_entries_total"][0][1] > both["crossover_event_log_entries_total"][0][1]
    assert later["crossover_event_log_dropped_total"][0][1] == 0
    assert {labels["code"]: v for labels, v in later["crossover_rpc_errors_total"]}.get("FAILED_PRECONDITION", 0) >= 1
    assert {labels["decision"] for labels, _v in later["crossover_policy_decisions_total"]} == {
        "overtake", "preempt", "held_back", "guard", "budget", "floor", "cut"}
    assert not later.get("crossover_isolation_budget")  # equal classes: no device has a controller

    for j in jobs:
        assert j.wait(120) == 0, j.output()[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _scrape(metrics_port)["crossover_jobs"][0][1] != 0:
        time.sleep(0.2)
    done = _scrape(metrics_port)
    assert done["crossover_jobs"][0][1] == 0
    assert "crossover_grants_total" not in done, "a job's series outlived the job"
    assert "crossover_compute_seconds_count" not in done

    d.stop()
    with pytest.raises(grpc.RpcError):
        _health(f"127.0.0.1:{health_port}")
