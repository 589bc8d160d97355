"""DaemonMetrics counted from a real scheduler's event log: values, and per-job series that end with the job."""
from __future__ import annotations

import pytest

from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.metrics import DaemonMetrics, parse_address
from crossover.daemon.policies.classes import ClassSettings, Priority
from crossover.daemon.policies.isolation import IsolationSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.identity import RankIdentity
from tests.unit.daemon.scheduler._world import FakeClock, event


@pytest.mark.parametrize("text,address", [("127.0.0.1:9464", ("127.0.0.1", 9464)), (":9464", ("127.0.0.1", 9464)),
                                          ("9464", ("127.0.0.1", 9464)), ("[::1]:0", ("::1", 0)),
                                          ("0.0.0.0:80", ("0.0.0.0", 80))])
def test_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["host", "host:", "host:99999", "h:x"])
def test_bad_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def _rank(core: Scheduler, job: str, rank: int) -> str:
    ident = RankIdentity(job_id=f"id-{job}", job_name=job, rank=rank, local_rank=0, world_size=2, local_size=1,
                         device=0, pid=4242 + rank)
    return core.register(ident).session_id


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def core(clock: FakeClock) -> Scheduler:
    return Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]),
                     SchedulerSettings(policy="exclusive", node="n0", lease=False, adapt=False),
                     pid_alive=lambda _p: True, clock=clock)


def test_grants_phases_and_waits_are_counted_per_job(core: Scheduler, clock: FakeClock) -> None:
    m = DaemonMetrics(core, "9.9")
    a, b = _rank(core, "a", 0), _rank(core, "b", 0)
    get = m.registry.get_sample_value
    event(core, a, "compute_request", iteration=1, seq=1)
    event(core, b, "compute_request", iteration=1, seq=1)
    clock.advance(0.05)
    event(core, a, "compute_done", iteration=1, duration_s=0.05)
    event(core, a, "comm_begin", iteration=1)
    clock.advance(0.2)
    event(core, a, "comm_end", iteration=1, duration_s=0.2)
    labels_a = {"device": "0", "job_name": "a", "job_id": "id-a"}
    assert get("crossover_grants_total", labels_a) == 1
    assert get("crossover_grants_total", {**labels_a, "job_name": "b", "job_id": "id-b"}) == 1
    assert get("crossover_grant_wait_seconds_count", labels_a) == 1
    assert get("crossover_compute_seconds_count", {"job_name": "a", "job_id": "id-a"}) == 1
    assert get("crossover_comm_seconds_sum", {"job_name": "a", "job_id": "id-a"}) == pytest.approx(0.2)
    assert get("crossover_device_busy", {"device": "0"}) == 1
    assert get("crossover_device_holder", {"device": "0", "job_name": "b", "job_id": "id-b"}) == 1
    assert get("crossover_jobs") == 2
    assert get("crossover_daemon_info", {"version": "9.9", "node": "n0", "policy": "exclusive"}) == 1


def test_a_jobs_series_go_when_its_last_rank_leaves(core: Scheduler) -> None:
    m = DaemonMetrics(core)
    first, second = _rank(core, "a", 0), _rank(core, "a", 1)
    event(core, first, "compute_request", iteration=1, seq=1)
    labels = {"device": "0", "job_name": "a", "job_id": "id-a"}
    core.close(first, "done")
    assert m.registry.get_sample_value("crossover_grants_total", labels) == 1, "one rank of the job is still here"
    core.close(second, "done")
    assert m.registry.get_sample_value("crossover_grants_total", labels) is None
    assert m.registry.get_sample_value("crossover_jobs") == 0


def test_evictions_and_fail_opens_are_counted(core: Scheduler) -> None:
    m = DaemonMetrics(core)
    a, b = _rank(core, "a", 0), _rank(core, "b", 0)
    event(core, a, "compute_request", iteration=1, seq=1)
    event(core, b, "compute_request", iteration=1, seq=1)
    event(core, b, "compute_done", iteration=1, duration_s=0.05)  # b went ahead without its grant
    assert m.registry.get_sample_value("crossover_fail_opens_total", {"job_name": "b", "job_id": "id-b"}) == 1
    core.close(a, "no heartbeat", evicted=True)
    assert m.registry.get_sample_value("crossover_evictions_total", {"device": "0"}) == 1


def test_a_failing_listener_never_stops_the_scheduler(core: Scheduler) -> None:
    def broken(_entry: dict) -> None:
        raise RuntimeError("boom")

    core.events.add_listener(broken)
    a = _rank(core, "a", 0)
    event(core, a, "compute_request", iteration=1, seq=1)
    assert [e.name for e in core.events.events()][-1] == "grant"


def test_device_time_is_counted_by_class_and_preemptions_by_device(clock: FakeClock) -> None:
    settings = SchedulerSettings(policy="crossover", node="n0", lease=False, adapt=False,
                                 classes=ClassSettings(isolation=IsolationSettings(target=0)))
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]), settings, pid_alive=lambda _p: True, clock=clock)
    m = DaemonMetrics(core, "9.9")
    get = m.registry.get_sample_value
    low = core.register(RankIdentity(job_id="id-low", job_name="low", rank=0, local_rank=0, world_size=1,
                                     local_size=1, device=0, pid=4242), asked=Priority.LOW,
                        accepts_preempt=True).session_id
    prod = _rank(core, "prod", 0)
    event(core, low, "compute_request", iteration=0, seq=1)
    clock.advance(0.25)
    event(core, prod, "compute_request", iteration=0, seq=1)  # a higher rank asks: the low holder is asked to yield
    assert get("crossover_preemptions_total", {"device": "0"}) == 1
    event(core, low, "compute_done", duration_s=0.25, yields=True)
    clock.advance(0.5)
    event(core, prod, "compute_done", duration_s=0.5, comm_begins=True)
    assert get("crossover_class_compute_seconds_total", {"priority": "low"}) == pytest.approx(0.25)
    assert get("crossover_class_compute_seconds_total", {"priority": "normal"}) == pytest.approx(0.5)
