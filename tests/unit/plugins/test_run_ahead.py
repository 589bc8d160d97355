"""`RunAhead`, the bound on how far an outranked rank's CPU runs ahead of its GPU, with marks that record
when they are waited for instead of CUDA events."""
from __future__ import annotations

import pytest

from crossover.plugins.hook.cuda_turns import RunAhead


class Mark:
    def __init__(self, n: int, log: list[int]) -> None:
        self.n, self._log = n, log

    def synchronize(self) -> None:
        self._log.append(self.n)


def _run_ahead(depth: int) -> tuple[RunAhead, list[int]]:
    waited: list[int] = []
    made = iter(range(100))
    return RunAhead(depth, mark=lambda: Mark(next(made), waited)), waited


def test_at_most_depth_marks_stay_unfinished_and_the_oldest_is_waited_for_first():
    bound, waited = _run_ahead(2)
    bound()
    bound()
    assert waited == []  # two layers queued ahead is allowed
    bound()
    bound()
    bound()
    assert waited == [0, 1, 2]


def test_depth_one_waits_for_the_previous_boundary_at_every_call():
    bound, waited = _run_ahead(1)
    for _ in range(4):
        bound()
    assert waited == [0, 1, 2]


def test_a_bound_that_leaves_nothing_queued_is_refused():
    with pytest.raises(ValueError, match="depth 0"):
        RunAhead(0)


def test_on_a_gpu_every_module_forward_is_a_boundary_only_while_a_higher_class_shares_the_device():
    torch = pytest.importorskip("torch")
    from crossover.plugins.hook.phase_reporter import PhaseReporter
    from crossover.plugins.hook.phase_tracking import follow_outranked, pace_on_gpu, remove_forward_boundaries

    class Session:
        outranked = False
        shares_device = True

        def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
            return True

        def take_preempted(self) -> bool:
            return False

    paced: list[str] = []
    session = Session()
    phases = PhaseReporter(session, pace=lambda: paced.append("pace"))  # type: ignore[arg-type]
    pace_on_gpu(phases)  # keeps the pace it was given
    phases.ensure_holding()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    try:
        follow_outranked(phases)  # what each gradient does first
        model(torch.zeros(1, 4))
        assert paced == [] and phases.forward_hook is None  # nobody above it: no hook at all
        session.outranked = True
        follow_outranked(phases)
        follow_outranked(phases)  # one hook, however often it is followed
        model(torch.zeros(1, 4))
        assert paced == ["pace"] * 3  # the Sequential and its two layers
        session.outranked = False
        follow_outranked(phases)
        model(torch.zeros(1, 4))
        assert len(paced) == 3 and phases.forward_hook is None
        session.outranked = True
        follow_outranked(phases)
    finally:
        remove_forward_boundaries(phases)  # the plugin's uninstall
    model(torch.zeros(1, 4))
    assert len(paced) == 3
