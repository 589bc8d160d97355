"""A rank's phase state and the hook on Horovod's waits: a holder never waits for peers holding its device."""
from __future__ import annotations

import pytest

from crossover.plugins.hook.phase_reporter import PhaseReporter as RankPhases


class RecordingSession:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
        self.calls.append(("acquire", iteration))
        return True

    def release(self, iteration: int, duration_s: float = 0.0, comm_begins: bool = False,
                yields: bool = False, ticket: int = 0) -> None:
        self.calls.append(("yield" if yields else "release", iteration))

    hands_over = False

    def comm_begin(self, iteration: int) -> None:
        self.calls.append(("comm_begin", iteration))


def test_a_wait_for_peers_while_holding_yields_and_resumes_with_the_same_iteration():
    s = RecordingSession()
    p = RankPhases(s)
    p.ensure_holding()
    p.compute_done()
    p.comm_begin()
    p.comm_end(0.01)  # iteration 1 holds the device (the update)
    with p.waiting_for_peers():  # a metric allreduce after step()
        assert not p.holding
    assert p.holding and p.iteration == 1 and p.yields == 1
    assert s.calls == [("acquire", 0), ("release", 0), ("acquire", 1), ("yield", 1), ("acquire", 1)]


def test_a_wait_without_the_device_sends_nothing():
    s = RecordingSession()
    p = RankPhases(s)
    with p.waiting_for_peers():  # broadcast_parameters before the first step
        pass
    p.ensure_holding()
    p.compute_done()
    with p.waiting_for_peers():  # an allreduce in the comm phase (the optimizer's own, or Adasum's)
        pass
    assert s.calls == [("acquire", 0), ("release", 0)]


def test_a_poll_that_finds_work_unfinished_yields_until_the_next_phase_point():
    s = RecordingSession()
    p = RankPhases(s)
    p.ensure_holding()
    assert p.pause() is True and p.pause() is False  # a second unfinished poll changes nothing
    p.ensure_holding()  # zero_grad or the update: the device is asked for again, same iteration
    p.pause()
    p.comm_begin()  # or the allreduce begins: nothing is owed then
    p.resume()
    assert s.calls == [("acquire", 0), ("yield", 0), ("acquire", 0), ("yield", 0), ("comm_begin", 0)]


def test_two_optimizers_share_one_iteration_counter():
    s = RecordingSession()
    p = RankPhases(s)
    for _ in range(2):  # a GAN: discriminator then generator, each with its allreduce
        p.ensure_holding()
        p.compute_done()
        p.comm_begin()
        p.comm_end(0.01)
    assert p.iteration == 2
    assert [c for c in s.calls if c[0] == "acquire"] == [("acquire", 0), ("acquire", 1), ("acquire", 2)]


def test_horovods_waits_route_through_the_rank_phases():
    pytest.importorskip("horovod.torch")
    import horovod.torch as hvd
    import horovod.torch.functions as hvd_functions
    import horovod.torch.mpi_ops as mpi_ops

    from crossover.plugins.hook import horovod_waits
    from crossover.plugins.hook.runtime import RUNTIME

    original, original_poll = mpi_ops.synchronize, mpi_ops.poll
    s = RecordingSession()
    p = RankPhases(s)
    p.ensure_holding()
    horovod_waits.install(p)
    try:
        for module in (hvd, mpi_ops, hvd_functions):
            assert module.synchronize is not original, f"{module.__name__}.synchronize is not wrapped"
        hvd.synchronize(-12345)  # an unknown handle returns at once, through the wrapper
        assert s.calls[-2:] == [("yield", 0), ("acquire", 0)]
        RUNTIME.original_waits["poll"] = lambda handle: handle == 1
        assert hvd.poll(0) is False and not p.holding
        assert hvd.poll(1) is True and p.holding
    finally:
        RUNTIME.original_waits["poll"] = original_poll
        horovod_waits.uninstall()
    assert mpi_ops.synchronize is original and hvd.synchronize is original
    assert mpi_ops.poll is original_poll and hvd.poll is original_poll
