"""`crossover.auto.waiting()`: a wait outside Horovod frees the device, and the rank's turn is kept."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
from crossover.plugins.hook import rank_session  # noqa: E402
from crossover.plugins.hook.phase_reporter import PhaseReporter  # noqa: E402
from crossover.plugins.hook.runtime import RUNTIME  # noqa: E402
from tests.unit.plugins.test_phase_reporter import Clock, Session  # noqa: E402


def test_without_a_session_the_block_just_runs():
    ran = []
    with rank_session.waiting():
        ran.append(1)
    assert ran == [1]


def test_a_holder_hands_the_device_back_for_the_wait_and_asks_again_with_the_same_iteration(monkeypatch):
    clock, session = Clock(), Session()
    reporter = PhaseReporter(session, clock=clock)
    reporter.ensure_holding()
    monkeypatch.setattr(RUNTIME, "phases", reporter)
    with rank_session.waiting():
        assert not reporter.holding
        clock.now += 2.0
    assert reporter.holding
    assert session.calls == [("acquire", 0, None), ("release", 0, 0.0, False, True), ("acquire", 0, None)]


def test_a_rank_that_does_not_hold_asks_for_nothing(monkeypatch):
    session = Session()
    monkeypatch.setattr(RUNTIME, "phases", PhaseReporter(session, clock=Clock()))
    with rank_session.waiting():
        pass
    assert session.calls == []


def test_without_resume_the_device_is_asked_for_again_only_at_the_next_phase_point(monkeypatch):
    clock, session = Clock(), Session()
    reporter = PhaseReporter(session, clock=clock)
    reporter.ensure_holding()
    monkeypatch.setattr(RUNTIME, "phases", reporter)
    with rank_session.waiting(resume=False):
        pass
    assert not reporter.holding
    assert session.calls[-1] == ("release", 0, 0.0, False, True)
    reporter.ensure_holding()  # zero_grad of the next piece of work
    assert reporter.holding and session.calls[-1] == ("acquire", 0, None)
