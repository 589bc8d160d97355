"""The session's pure parts on their own: late reports of a rank that does not wait, and a silent daemon."""
from __future__ import annotations

from crossover.client.rank.daemon_silence import Silence
from crossover.client.rank.late_reports import LateReports
from crossover.protos import MAX_BATCH_EVENTS
from crossover.protos import crossover_v1_pb2 as pb


def _done(i: int) -> pb.RankEvent:
    return pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=i)


def test_late_reports_go_once_the_oldest_is_due_each_dated_by_its_age():
    late = LateReports(interval_s=0.1)
    assert not late and late.take(1.0) is None
    assert late.hold(_done(0), 10.0) is False and late.hold(_done(1), 10.05) is False
    assert late.hold(_done(2), 10.125) is True  # the oldest is past 0.1 s old
    batch = late.take(10.25)
    assert batch.kind == pb.BATCH and [e.iteration for e in batch.batch] == [0, 1, 2]
    assert [round(e.ago_s, 3) for e in batch.batch] == [0.25, 0.2, 0.125] and not late


def test_a_full_batch_is_due_at_once():
    late = LateReports(interval_s=60.0)
    due = [late.hold(_done(i), 1.0) for i in range(MAX_BATCH_EVENTS)]
    assert due[-1] and not any(due[:-1])


def test_a_daemon_is_frozen_only_once_it_answered_before_and_then_fell_silent_for_the_limit():
    s = Silence(limit_s=1.0)
    s.sent(0.0)
    assert s.check(5.0) == 0.0  # it never answered a heartbeat: an old daemon, not a frozen one
    s.answers = True
    assert s.heard() is False
    s.sent(10.0)
    s.sent(10.5)  # the oldest unanswered one counts
    assert s.check(10.9) == 0.0 and not s.frozen
    assert s.check(11.25) == 1.25 and s.frozen
    assert s.check(12.0) == 0.0  # said once
    assert s.heard() is True and not s.frozen
    s.reset()
    assert (s.answers, s.since, s.frozen) == (False, None, False)
