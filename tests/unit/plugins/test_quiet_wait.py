"""The plugin's quiet wait: only while another rank may need the device's core."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("horovod.torch")
from crossover.plugins.hook import phase_tracking as ht  # noqa: E402
from crossover.plugins.hook.phase_reporter import PhaseReporter as RankPhases  # noqa: E402


class FakeSession:
    def __init__(self, shares_device: bool) -> None:
        self.shares_device = shares_device
        self.outranked = False
        self.calls: list[str] = []

    def comm_begin(self, iteration: int) -> None:
        self.calls.append("comm_begin")

    def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
        self.calls.append("acquire")
        return True

    def release(self, iteration: int, duration_s: float = 0.0, comm_begins: bool = False,
                yields: bool = False) -> None:
        self.calls.append("release")


class FakeOptimizer(torch.optim.SGD):
    """Stands in for Horovod's DistributedOptimizer: its own synchronize, nothing in flight."""

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("shares_device, quiet, waits", [(True, True, 1), (False, True, 0), (True, False, 0)])
def test_the_quiet_wait_is_only_for_a_shared_device(monkeypatch, shares_device, quiet, waits):
    waited: list[object] = []
    monkeypatch.setattr(ht, "_wait_quietly", waited.append)
    opt = FakeOptimizer([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    session = FakeSession(shares_device)
    ht._PhaseTracker(opt, RankPhases(session), quiet_wait=quiet).attach()  # type: ignore[arg-type]
    opt.synchronize()
    assert len(waited) == waits
    assert session.calls[-1] == "acquire"  # the allreduce's end still opens the next compute phase
