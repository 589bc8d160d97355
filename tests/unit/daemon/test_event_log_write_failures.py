"""The event log's file when writes fail: retried and reported, never silently ended; its queue bounded."""
from __future__ import annotations

import errno
import logging
import shutil

from crossover.daemon.event_log import EventLog
from crossover.protos.event_file import read_jsonl, typed
from crossover.protos.event_records import CommBegin


def _iterations(path) -> list[int]:
    return [CommBegin.of(e).iteration for e in typed(read_jsonl(path))]


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    closed = False

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None: ...

    def close(self) -> None:
        self.closed = True


def test_a_failed_write_is_retried_and_the_log_goes_on(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path, flush_interval_s=3600, retry_s=0.0)
    try:
        for i in range(3):
            log.record(CommBegin(iteration=i))
        log.flush()
        log._file = _FullDisk()  # type: ignore[assignment]  # noqa: SLF001 - the disk fills up
        log.record(CommBegin(iteration=3))
        log.record(CommBegin(iteration=4))
        with caplog.at_level(logging.WARNING, logger="crossover.daemon.event_log"):
            log.flush()
            assert _iterations(path) == [0, 1, 2]
            assert "write failed" in caplog.text and log.dropped == 0
            log.record(CommBegin(iteration=5))
            log.flush()  # the disk has room again: the file is reopened and nothing was lost
            assert "work again" in caplog.text
        assert _iterations(path) == [0, 1, 2, 3, 4, 5]
    finally:
        log.close()


def test_while_writes_fail_the_queue_keeps_the_newest_entries_and_counts_the_rest(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "events.jsonl"
    log = EventLog(maxlen=4, path=path, flush_interval_s=3600, retry_s=0.0)
    try:
        log._file = _FullDisk()  # type: ignore[assignment]  # noqa: SLF001
        shutil.rmtree(folder)  # and reopening fails too, until the folder is back
        for i in range(10):
            log.record(CommBegin(iteration=i))
            log.flush()
        assert log.dropped == 6
        folder.mkdir()
        log.flush()
        assert _iterations(path) == [6, 7, 8, 9]
    finally:
        log.close()


def test_a_failed_write_waits_for_the_retry_interval(tmp_path):
    log = EventLog(path=tmp_path / "e.jsonl", flush_interval_s=3600, retry_s=60.0)
    try:
        log._file = _FullDisk()  # type: ignore[assignment]  # noqa: SLF001
        log.record(CommBegin(iteration=0))
        log.flush()
        log.record(CommBegin(iteration=1))
        log.flush()  # within the retry interval: nothing tried
        assert read_jsonl(tmp_path / "e.jsonl") == [] and len(log._unwritten) == 2  # noqa: SLF001
    finally:
        log._failures = 0  # noqa: SLF001
        log.close()
    assert len(read_jsonl(tmp_path / "e.jsonl")) == 2  # close() makes a last try
