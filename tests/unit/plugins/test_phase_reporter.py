"""The phase reporter on its own: an injected clock, a recording session, no daemon, Horovod or torch."""
from __future__ import annotations

import logging

from crossover.plugins.hook.phase_reporter import PhaseReporter


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


class Session:
    def __init__(self) -> None:
        self.shares_device = True
        self.calls: list[tuple] = []

    def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
        self.calls.append(("acquire", iteration, comm_s))
        return True

    def release(self, iteration: int, duration_s: float = 0.0, comm_begins: bool = False,
                yields: bool = False, ticket: int = 0) -> None:
        self.calls.append(("release", iteration, duration_s, comm_begins, yields) + ((ticket,) if ticket else ()))

    hands_over = False
    tickets = 0

    def end_turn(self) -> int:
        self.tickets += 1
        self.calls.append(("end_turn", self.tickets))
        return self.tickets

    def comm_begin(self, iteration: int) -> None:
        self.calls.append(("comm_begin", iteration))

    preempted = False
    outranked = False

    def take_preempted(self) -> bool:
        asked, self.preempted = self.preempted, False
        return asked


def test_a_release_reports_the_time_since_the_grant_on_the_injected_clock():
    clock, session = Clock(), Session()
    reporter = PhaseReporter(session, clock=clock)
    reporter.ensure_holding()
    clock.now += 0.25
    reporter.compute_done()
    assert session.calls == [("acquire", 0, None), ("release", 0, 0.25, True, False)]


def test_the_allreduce_end_advances_the_iteration_and_rides_on_the_next_request():
    clock, session = Clock(), Session()
    reporter = PhaseReporter(session, clock=clock)
    reporter.comm_begin()  # not holding: the daemon is told the allreduce began, once
    reporter.comm_begin()
    reporter.comm_end(0.5)
    assert reporter.iteration == 1 and reporter.holding and not reporter.in_comm
    assert session.calls == [("comm_begin", 0), ("acquire", 1, 0.5)]


def test_settle_runs_before_every_release_and_only_then():
    clock, session = Clock(), Session()
    settled: list[int] = []
    reporter = PhaseReporter(session, settle=lambda: settled.append(len(session.calls)), clock=clock)
    reporter.ensure_holding()
    assert settled == []
    reporter.pause()
    reporter.resume()
    reporter.comm_begin()
    assert settled == [1, 3]  # each time before the release was sent
    assert [call[0] for call in session.calls] == ["acquire", "release", "acquire", "release"]


def test_phase_starts_are_announced_with_the_iteration_they_begin():
    session = Session()
    starts: list[int] = []
    reporter = PhaseReporter(session)
    reporter.on_phase_start.append(lambda: starts.append(reporter.iteration))
    reporter.ensure_holding()
    reporter.compute_done()
    reporter.comm_begin()
    reporter.comm_end(0.1)
    assert starts == [0, 1]
    assert [call[0] for call in session.calls][:1] == ["acquire"]  # no collective or extra call before it


def test_a_failing_session_never_reaches_training(caplog):
    class Broken(Session):
        def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
            raise RuntimeError("daemon gone")

    reporter = PhaseReporter(Broken())
    with caplog.at_level(logging.ERROR, logger="crossover.plugins.hook.phase_reporter"):
        assert reporter.ensure_holding() is None
    assert "continuing unscheduled" in caplog.text
    assert not reporter.holding


def test_a_preempted_holder_yields_at_the_next_gradient_and_asks_again_for_the_same_iteration():
    clock, session = Clock(), Session()
    reporter = PhaseReporter(session, clock=clock)
    reporter.ensure_holding()
    reporter.yield_if_asked()  # nobody asked: nothing
    session.preempted = True
    clock.now += 0.5
    reporter.yield_if_asked()
    assert session.calls == [("acquire", 0, None), ("release", 0, 0.5, False, True), ("acquire", 0, None)]
    assert reporter.holding and reporter.yields == 1
    session.preempted = True
    reporter.compute_done()
    reporter.yield_if_asked()  # no longer holding: the ask is spent, nothing happens
    assert session.calls[-1][0] == "release" and not session.preempted


def test_a_rank_that_hands_over_on_its_device_queues_a_ticket_instead_of_settling():
    clock, session = Clock(), Session()
    settled: list[int] = []
    reporter = PhaseReporter(session, settle=lambda: settled.append(1), clock=clock)
    session.hands_over = True
    reporter.ensure_holding()
    reporter.compute_done()
    reporter.comm_end(0.1)
    reporter.compute_done()
    assert settled == []
    assert [c for c in session.calls if c[0] != "acquire"] == [
        ("end_turn", 1), ("release", 0, 0.0, True, False, 1), ("end_turn", 2), ("release", 1, 0.0, True, False, 2)]
    session.hands_over = False  # a rank without the hand-over on its device settles as before
    reporter.comm_end(0.1)
    reporter.compute_done()
    assert settled == [1] and session.calls[-1] == ("release", 2, 0.0, True, False)


def test_an_outranked_holder_paces_at_each_boundary_and_then_yields_if_asked():
    clock, session = Clock(), Session()
    paced: list[int] = []
    reporter = PhaseReporter(session, clock=clock, pace=lambda: paced.append(len(session.calls)))
    reporter.at_boundary()  # not holding: nothing queued to bound
    reporter.ensure_holding()
    reporter.at_boundary()  # holding but nobody above it: its CPU may run ahead
    assert paced == []
    session.outranked = True
    reporter.at_boundary()
    assert paced == [1] and reporter.holding
    session.preempted = True
    reporter.at_boundary()  # paced first, so the yield finds little of its work still queued
    assert paced == [1, 1]
    assert session.calls[1:] == [("release", 0, 0.0, False, True), ("acquire", 0, None)]
