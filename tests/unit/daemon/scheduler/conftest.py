"""The scheduler tests' fixtures: a fake clock, a fake `pid_alive` and schedulers on CPU devices built on them."""
from __future__ import annotations

import pytest

from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from tests.unit.daemon.scheduler._world import FakeClock, FakePids


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pids() -> FakePids:
    return FakePids()


@pytest.fixture
def make(clock, pids):
    """Build a scheduler on N CPU devices with the fakes injected."""
    made: list[Scheduler] = []

    def build(policy: str = "exclusive", n_devices: int = 2, timeout: float = 0.5,
              evict_after: float = 5.0, lease: bool = False,
              max_sessions: int = SchedulerSettings.max_sessions) -> Scheduler:
        inv = Inventory([Device(i, "cpu", f"cpu{i}", (i,)) for i in range(n_devices)])
        settings = SchedulerSettings(policy=policy, node="node-t", heartbeat_interval_s=0.1, lease=lease, adapt=False,
                                     max_sessions=max_sessions,
                                     liveness=LivenessSettings(heartbeat_timeout_s=timeout, evict_after_s=evict_after))
        s = Scheduler(inv, settings, event_log=EventLog(clock=clock), clock=clock, pid_alive=pids)
        made.append(s)
        return s

    yield build
    for s in made:
        s.shutdown()
