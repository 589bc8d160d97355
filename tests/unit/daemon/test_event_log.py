"""The event log: memory at once, the file shortly after and completely at close."""
from __future__ import annotations

import json
import time

import pytest

from crossover.daemon.event_log import EventLog
from crossover.protos.event_file import FORMAT, Event, EventName, UnsupportedLog, read_events, read_jsonl, typed
from crossover.protos.event_records import CommBegin, Grant, RankTag, Release

RANK_0 = RankTag(job="j", job_name="job", rank=0, device=0, node="n0")


def _iterations(entries) -> list[int]:
    return [CommBegin.of(e).iteration for e in typed(entries)]


def test_file_follows_memory_within_the_flush_interval_and_close_writes_the_rest(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path=path, flush_interval_s=0.05)
    try:
        log.record(Grant(iteration=0, waited_s=0.0), about=RANK_0)
        assert [e["event"] for e in log.snapshot()] == ["grant"]
        deadline = time.monotonic() + 5
        while not read_jsonl(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e["event"] for e in read_jsonl(path)] == ["grant"]
        for i in range(500):
            log.record(CommBegin(iteration=i), about=RANK_0)
    finally:
        log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 502 and json.loads(lines[0]) == {"event": "log_format", "format": 1, "writer": "crossoverd"}
    assert _iterations(map(json.loads, lines[2:])) == list(range(500)), "order must be kept"


def test_a_failing_file_keeps_the_memory_log(tmp_path):
    log = EventLog(path=tmp_path / "ev.jsonl", flush_interval_s=60)
    log._file.close()  # the next write raises ValueError, as a vanished file would raise OSError
    log.record(Grant(iteration=0, waited_s=0.0), about=RANK_0)
    log.flush()
    log.record(Release(held_s=0.1), about=RANK_0)
    log.close()
    assert [e["event"] for e in log.snapshot()] == ["grant", "release"]


def test_memory_log_is_bounded():
    log = EventLog(maxlen=3)
    for i in range(10):
        log.record(CommBegin(iteration=i))
    assert _iterations(log.snapshot()) == [7, 8, 9]


def test_the_file_is_rotated_before_it_passes_max_bytes_and_only_backups_are_kept(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path=path, flush_interval_s=60, max_bytes=4000, backups=2)
    try:
        for i in range(400):
            log.record(CommBegin(iteration=i), about=RANK_0)
            if i % 10 == 9:
                log.flush()
    finally:
        log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ev.jsonl", "ev.jsonl.1", "ev.jsonl.2"]
    assert all((tmp_path / f).stat().st_size <= 4000 for f in files)
    newest = _iterations(e for f in ("ev.jsonl.2", "ev.jsonl.1", "ev.jsonl") for e in read_jsonl(tmp_path / f))
    assert newest == list(range(newest[0], 400)), "the kept files hold the newest events, in order"
    assert len(log.snapshot()) == 400  # memory is not affected


def test_every_file_starts_with_its_format_and_the_rotated_files_read_back_oldest_first(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path=path, flush_interval_s=60, max_bytes=4000, backups=2)
    try:
        for i in range(150):
            log.record(CommBegin(iteration=i), about=RANK_0)
            if i % 10 == 9:
                log.flush()
    finally:
        log.close()
    for f in ("ev.jsonl", "ev.jsonl.1"):
        assert json.loads((tmp_path / f).read_text().splitlines()[0])["format"] == FORMAT
    events = read_events(path, backups=2)
    assert _iterations(events) == list(range(150 - len(events), 150))
    assert all(e.name is EventName.COMM_BEGIN and e.rank == 0 for e in events)
    assert read_events(path) == events  # unasked, every rotated file there is read: stats and timeline see them
    assert len(read_events(path, backups=0)) < len(events)


def test_a_log_without_a_header_loads_as_format_1_and_a_newer_one_fails_in_one_line(tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text('{"t":1.0,"wall":2.0,"event":"grant","job":"j","rank":0}\n{"t":2.0,"event":"future_thing"}\n')
    grant, future = read_events(old)
    assert grant == Event(EventName.GRANT, 1.0, 2.0, {"job": "j", "rank": 0}) and grant.about_rank
    assert future.name == "future_thing" and grant.to_json()["event"] == "grant"
    new = tmp_path / "new.jsonl"
    new.write_text('{"event":"log_format","format":99}\n{"t":1.0,"event":"grant"}\n')
    with pytest.raises(UnsupportedLog, match="format 99"):
        read_events(new)
