"""Memory caps in the scheduler: told in each rank's share message, logged when they change, and followed through
joins, class changes and leaves; a refusal at the cap is kept for `crossover jobs` (fake clock, no process)."""
from __future__ import annotations

from crossover.daemon.event_log import EventLog
from crossover.daemon.events import EventKind, RankEvent
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.messages import ShareMsg
from crossover.daemon.policies.classes import Priority
from crossover.daemon.policies.memory import MemoryRules
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.event_records import MemoryCap, MemoryCapHit
from tests.unit.daemon.scheduler._world import drain_outbox, ident

GiB = 1 << 30


def scheduler(clock, pids, total: int = 80 * GiB, reserve: tuple[str, ...] = ("high=50%",)) -> Scheduler:
    inv = Inventory([Device(0, "gpu", "H200", memory_total=total)])
    settings = SchedulerSettings(policy="crossover", node="n", memory=MemoryRules.parse(reserve), adapt=False)
    return Scheduler(inv, settings, event_log=EventLog(clock=clock), clock=clock, pid_alive=pids)


def join(s: Scheduler, job: str, rank: int = 0, asked: Priority | None = None):
    reg = s.register(ident(job=job, rank=rank, name=job), asked=asked)
    return reg.session_id, s.attach(reg.session_id)


def last_cap(box) -> int | None:
    shares = [m for m in drain_outbox(box, shares=True) if isinstance(m, ShareMsg)]
    return shares[-1].memory_cap.limit


def caps_logged(s: Scheduler, job: str) -> list[int | None]:
    return [MemoryCap.of(e).cap_bytes for e in s.events.events() if e.name is MemoryCap.name and e.job_name == job]


def test_a_lower_job_is_capped_while_a_reserved_class_is_there(clock, pids):
    s = scheduler(clock, pids)
    low, low_box = join(s, "batch", asked=Priority.LOW)
    assert last_cap(low_box) is None and caps_logged(s, "batch") == []  # alone: nothing changes
    prod, prod_box = join(s, "prod")
    s.ownership.set_job_class("prod", Priority.HIGH)
    assert last_cap(low_box) == 40 * GiB and last_cap(prod_box) is None
    share = [m for m in drain_outbox(low_box, shares=True) if isinstance(m, ShareMsg)]
    assert share == []  # told once per change, not again
    assert caps_logged(s, "batch") == [40 * GiB] and caps_logged(s, "prod") == []
    why = [MemoryCap.of(e).why for e in s.events.events() if e.name is MemoryCap.name][0]
    assert why.startswith("40 GiB of 80 GiB, as high reserves 40 GiB")
    per_dev, _ = s.steering.snapshot()
    capped = {r.ident.job_name: r.memory_cap for r in per_dev[0].others + per_dev[0].waiting + per_dev[0].holders}
    assert capped == {"batch": 40 * GiB, "prod": None}

    s.ownership.set_job_class("prod", Priority.NORMAL)  # the operator lowers it mid-run: its reservation goes
    assert last_cap(low_box) is None and caps_logged(s, "batch") == [40 * GiB, None]
    s.ownership.set_job_class("prod", Priority.HIGH)
    assert last_cap(low_box) == 40 * GiB
    s.close(prod, "done")  # it leaves: its reservation is freed
    assert last_cap(low_box) is None and caps_logged(s, "batch") == [40 * GiB, None, 40 * GiB, None]


def test_a_jobs_ranks_on_one_device_share_its_cap(clock, pids):
    s = scheduler(clock, pids, reserve=("high=60%",))
    join(s, "prod")
    s.ownership.set_job_class("prod", Priority.HIGH)
    _, box0 = join(s, "batch", rank=0, asked=Priority.LOW)
    _, box1 = join(s, "batch", rank=1, asked=Priority.LOW)
    job_cap = 80 * GiB - int(0.6 * 80 * GiB)
    assert last_cap(box0) == last_cap(box1) == job_cap // 2


def test_a_refusal_at_the_cap_is_kept_for_the_jobs_listing_and_logged(clock, pids):
    s = scheduler(clock, pids)
    join(s, "prod")
    s.ownership.set_job_class("prod", Priority.HIGH)
    low, _ = join(s, "batch", asked=Priority.LOW)
    s.apply(low, RankEvent(EventKind.MEMORY_CAP_HIT, iteration=3, memory_bytes=2 * GiB))
    _, ranks = s.steering.snapshot()
    note = {r.ident.job_name: r.memory_note for r in ranks}["batch"]
    assert note.startswith("out of its memory cap at iteration 3, asking for 2 GiB more: it may hold 40 GiB of 80")
    hit = [MemoryCapHit.of(e) for e in s.events.events() if e.name is MemoryCapHit.name]
    assert hit == [MemoryCapHit(iteration=3, asked_bytes=2 * GiB, cap_bytes=40 * GiB)]


def test_without_a_reservation_or_a_known_total_nobody_is_capped(clock, pids):
    for s in (scheduler(clock, pids, reserve=()), scheduler(clock, pids, total=0)):
        join(s, "prod")
        s.ownership.set_job_class("prod", Priority.HIGH)
        low, box = join(s, "batch", asked=Priority.LOW)
        assert last_cap(box) is None
        s.apply(low, RankEvent(EventKind.MEMORY_CAP_HIT, iteration=1))  # the device itself was full: no cap to blame
        assert not [e for e in s.events.events() if e.name.startswith("memory_cap")]
        s.shutdown()
