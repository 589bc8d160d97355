"""The event log's typed records: one per event, written through `EventLog` and read back equal, old and
newer lines read, other lines refused."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from crossover.daemon.event_log import EventLog
from crossover.protos.event_file import Event, EventName, read_events
from crossover.protos.event_records import (
    RANK_KEYS,
    RECORDS,
    Adapt,
    Cancel,
    CommBegin,
    CommEnd,
    Drain,
    DrainRefused,
    Evict,
    Grant,
    Handover,
    HandoverRescue,
    HandoverSwitch,
    Isolation,
    JobClass,
    JobClassSet,
    Lease,
    LeaseExpired,
    LeaseReleased,
    LeaseRevoke,
    Leave,
    MemoryCap,
    MemoryCapHit,
    Overdue,
    OverdueDone,
    Policy,
    Preempt,
    RankTag,
    Record,
    Register,
    Release,
    Request,
    Resume,
    Sharing,
    Suspend,
    payload,
)

TAG = RankTag(job="9b6a39067e5c", job_name="resnet", rank=1, device=2, node="node0")

ABOUT_A_RANK = [
    Register(pid=4242, world_size=4, framework="ddp"), Leave(reason="stream ended", evicted=False),
    Leave(reason="daemon shutdown"), Request(iteration=7, seq=8), Grant(iteration=7, waited_s=0.25),
    Grant(iteration=7, waited_s=0.0, after=3), Release(held_s=0.5), Release(held_s=0.1, yields=True),
    Release(reason="suspended"), Cancel(), CommBegin(iteration=7), CommEnd(iteration=7, duration_s=0.125),
    Overdue(held_s=9.5, iteration=7, limit_s=3.0), Overdue(held_s=1.5, iteration=7, reason="evicted by the operator"),
    OverdueDone(late_s=2.0), Suspend(reason="no heartbeat for 6.00s", phase="compute"), Resume(silent_s=6.5),
    Lease(), Lease(opened=True), LeaseRevoke(reason="another rank joined the device"), LeaseReleased(), LeaseExpired(),
    JobClass(priority="low", weight=2.0, by="operator"), Preempt(), Handover(path="device"),
    HandoverRescue(ticket=5, reason="its device did not end its turn"), MemoryCap(cap_bytes=None, why=""),
    MemoryCap(cap_bytes=8 << 30, why="its share: 8 GiB"),
    MemoryCapHit(iteration=3, asked_bytes=1 << 20, cap_bytes=1 << 30),
]
ABOUT_THE_NODE = [
    DrainRefused(device=1, job="j1", job_name="late", rank_refused=0),
    Policy(old="crossover", new="exclusive", protect=0.97, caller="admin socket, uid 0 (root)"),
    Drain(device=1, caller="uid 0"), Resume(device=1, caller="uid 0"),
    Evict(device=-1, job="sweep", touched=2, caller="uid 0"),
    Sharing(device=0, mode="unscheduled", reason="grants do not pay: 0.91x", score=0.91),
    Sharing(device=0, mode="scheduled", reason="its jobs differ in weight", score=None),
    Isolation(device=0, window="shared", budget=0.25, reference_s=0.1, current_s=0.11, reason="kept 0.91"),
    Isolation(device=0, window="solo", budget=-1.0, reference_s=None, current_s=None, reason="first solo window"),
    Adapt(on=False, caller="uid 0"), HandoverSwitch(on=True, caller=""),
    JobClassSet(job="j1", priority="high", weight=1.0, caller="uid 0"),
]


def test_every_event_has_exactly_one_record_and_every_sample_set_is_complete() -> None:
    assert set(RECORDS) == set(EventName) and all(RECORDS[name].name is name for name in EventName)
    assert {type(r) for r in ABOUT_A_RANK + ABOUT_THE_NODE} == set(RECORDS.values())
    with pytest.raises(TypeError, match="is the record of grant already"):
        @dataclass(frozen=True, kw_only=True)
        class Grant2(Record):
            name: ClassVar[EventName] = EventName.GRANT
    assert RECORDS[EventName.GRANT] is Grant


def test_no_record_of_an_event_about_a_rank_holds_a_key_of_its_tag() -> None:
    named_like_the_tag = {type(r).__name__ for r in ABOUT_A_RANK
                          if {f.name for f in dataclasses.fields(r)} & set(RANK_KEYS)}
    assert named_like_the_tag == {"Resume"}  # its device: a drained device resumed, which has no rank
    assert not any(r.fields().keys() & set(RANK_KEYS) for r in ABOUT_A_RANK)


@pytest.mark.parametrize("about", [True, False], ids=["about a rank", "about the node"])
def test_every_record_written_through_the_event_log_reads_back_equal(tmp_path, about: bool) -> None:
    records = ABOUT_A_RANK if about else ABOUT_THE_NODE
    log = EventLog(path=tmp_path / "ev.jsonl", flush_interval_s=60)
    for i, record in enumerate(records):
        log.record(record, t=float(i), about=TAG if about else None)
    log.close()
    events = read_events(tmp_path / "ev.jsonl")
    assert [e.name for e in events] == [r.name for r in records]
    assert [type(r).of(e) for e, r in zip(events, records)] == records
    assert [payload(e) for e in events] == records
    assert all((e.job, e.job_name, e.rank, e.device, e.node) == (TAG.job, TAG.job_name, TAG.rank, TAG.device,
                                                                 TAG.node) for e in events) == about


def test_the_lines_keep_their_layout_and_an_optional_field_is_written_only_when_it_is_not_its_default() -> None:
    log = EventLog(clock=lambda: 10.0, wall_clock=lambda: 1000.0)
    lines = [log.record(Grant(iteration=7, waited_s=0.25), about=TAG),
             log.record(Grant(iteration=7, waited_s=0.0, after=3), about=TAG),
             log.record(Leave(reason="daemon shutdown"), about=TAG),
             log.record(Lease(opened=True), about=TAG),
             log.record(Resume(device=1, caller="uid 0")),
             log.record(Isolation(device=0, window="solo", budget=-1.0, reference_s=None, current_s=None,
                                  reason="r"), t=9.5)]
    rank = ["t", "wall", "event", "job", "job_name", "rank", "device", "node"]
    assert [list(x) for x in lines] == [
        [*rank, "iteration", "waited_s"], [*rank, "iteration", "waited_s", "after"], [*rank, "reason"],
        [*rank, "opened"], ["t", "wall", "event", "device", "caller"],
        ["t", "wall", "event", "device", "window", "budget", "reference_s", "current_s", "reason"]]
    assert lines[5]["t"] == 9.5 and lines[5]["wall"] == 999.5 and lines[5]["reference_s"] is None


def test_a_record_about_a_rank_cannot_carry_a_key_of_its_tag() -> None:
    with pytest.raises(ValueError, match="from its tag"):
        EventLog().record(Resume(device=1, caller="uid 0"), about=TAG)


def _event(line: str) -> Event:
    event = Event.from_json(json.loads(line))
    assert event is not None
    return event


def test_an_unknown_key_of_a_newer_daemon_is_ignored() -> None:
    grant = _event('{"t":1.0,"wall":2.0,"event":"grant","job":"j","job_name":"n","rank":0,"device":0,"node":"x",'
                   '"iteration":4,"waited_s":0.5,"priority_boost":true}')
    assert Grant.of(grant) == Grant(iteration=4, waited_s=0.5)


def test_an_old_line_without_an_optional_field_reads_with_its_default() -> None:
    register = _event('{"t":1.0,"wall":2.0,"event":"register","job":"j","job_name":"n","rank":0,"device":0,'
                      '"node":"x","pid":5,"world_size":2}')
    assert Register.of(register) == Register(pid=5, world_size=2, framework=None)
    policy = _event('{"t":1.0,"wall":2.0,"event":"policy","old":"crossover","new":"exclusive","caller":"uid 0"}')
    assert Policy.of(policy).protect is None
    release = _event('{"t":1.0,"event":"release","job":"j","rank":0,"held_s":0.5}')
    assert Release.of(release) == Release(held_s=0.5, yields=False, reason=None)


def test_a_rank_events_tag_is_not_its_payload() -> None:
    resumed = _event('{"t":1.0,"event":"resume","job":"j","job_name":"n","rank":0,"device":3,"node":"x",'
                     '"silent_s":6.5}')
    assert Resume.of(resumed) == Resume(silent_s=6.5) and resumed.device == 3


def test_a_json_integer_reads_as_the_float_it_stands_for() -> None:
    grant = Grant.of(_event('{"t":1.0,"event":"grant","job":"j","rank":0,"iteration":1,"waited_s":0}'))
    assert grant.waited_s == 0.0 and isinstance(grant.waited_s, float)


@pytest.mark.parametrize("line, why", [
    ('{"t":1.0,"event":"release","job":"j","rank":0,"held_s":0.5}', "not a grant event"),
    ('{"t":1.0,"event":"grant","job":"j","rank":0,"iteration":1}', "lacks 'waited_s'"),
    ('{"t":1.0,"event":"grant","job":"j","rank":0,"iteration":1,"waited_s":"soon"}', "waited_s='soon'"),
    ('{"t":1.0,"event":"grant","job":"j","rank":0,"iteration":true,"waited_s":0.5}', "iteration=True"),
    ('{"t":1.0,"event":"grant","job":"j","rank":0,"iteration":1.5,"waited_s":0.5}', "iteration=1.5"),
])
def test_another_event_or_a_damaged_line_is_refused(line: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Grant.of(_event(line))


def test_an_event_of_a_name_this_code_does_not_know_has_no_record() -> None:
    future = _event('{"t":1.0,"event":"future_thing","x":1}')
    assert payload(future) is None and future.fields == {"x": 1}
