"""The DDP front end's phase points on a real one-rank DDP module (Gloo, in process) and a recording session."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from crossover.plugins.hook import ddp_torch  # noqa: E402
from crossover.plugins.hook.phase_reporter import PhaseReporter  # noqa: E402
from crossover.plugins.hook.runtime import RUNTIME  # noqa: E402
from tests.unit.plugins.test_phase_reporter import Session  # noqa: E402


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Out:
    """An output type of the script's own: the tensors are attributes."""

    def __init__(self, logits):
        self.logits = logits


class _Wrapped(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return _Out(self.net(x))


def _ddp(net=None, **kwargs):
    torch.manual_seed(0)
    net = net or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model = torch.nn.parallel.DistributedDataParallel(net, **kwargs)
    session = Session()
    phases = PhaseReporter(session)
    ddp_torch._Tracker(model, phases).attach()
    return model, session, phases


def _step(model, opt=None, sync=True):
    x = torch.randn(4, 8)
    if sync:
        model(x).sum().backward()
    else:
        with model.no_sync():
            model(x).sum().backward()
    if opt is not None:
        opt.step()


def _kinds(session):
    return [(c[0], c[1]) + ((c[3],) if c[0] == "release" else ()) for c in session.calls]


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"static_graph": True},
                                    {"gradient_as_bucket_view": True}], ids=["plain", "find_unused", "static",
                                                                             "bucket_view"])
def test_each_step_is_one_compute_phase_then_one_allreduce(group, kwargs):
    model, session, phases = _ddp(**kwargs)
    for _ in range(3):
        _step(model)
    # forward: ask; backward's last node: release, the allreduce begins; DDP done: ask for the next iteration
    assert _kinds(session) == [("acquire", 0), ("release", 0, True), ("acquire", 1), ("release", 1, True),
                               ("acquire", 2), ("release", 2, True), ("acquire", 3)]
    assert all(c[2] is not None and c[2] >= 0 for c in session.calls[2::2]), "each ask after an allreduce times it"
    assert phases.iteration == 3


def test_an_output_of_the_scripts_own_type_is_followed(group):
    model, session, _ = _ddp(_Wrapped(torch.nn.Linear(8, 2)))
    model(torch.randn(4, 8)).logits.sum().backward()
    assert _kinds(session) == [("acquire", 0), ("release", 0, True), ("acquire", 1)]


def test_the_forwards_buffer_broadcast_hands_the_device_back(group):
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    model, session, _ = _ddp(net)
    _step(model)
    _step(model)
    # the second forward holds the device when DDP broadcasts BatchNorm's buffers: a yield for that wait
    assert ("release", 1, False) in _kinds(session)[2:]
    assert _kinds(session)[-2:] == [("release", 1, True), ("acquire", 2)]


def test_accumulation_under_no_sync_stays_one_compute_phase(group):
    model, session, _ = _ddp()
    _step(model, sync=False)
    _step(model, sync=False)
    _step(model)
    assert _kinds(session) == [("acquire", 0), ("release", 0, True), ("acquire", 1)]


def test_a_forward_without_gradients_reduces_nothing(group):
    model, session, _ = _ddp()
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert _kinds(session) == [("acquire", 0)]


def test_a_blocking_collective_hands_the_device_back_for_its_wait(group, monkeypatch):
    from crossover.plugins.hook import torch_collectives

    assert not torch_collectives._originals, "torch.distributed is already wrapped in this process"
    model, session, phases = _ddp()
    before = dist.all_reduce
    torch_collectives.install()
    monkeypatch.setattr(RUNTIME, "phases", phases)
    try:
        _step(model)
        dist.all_reduce(torch.ones(1))  # a metric: a yield, then the same iteration again
        work = dist.all_reduce(torch.ones(1), dist.ReduceOp.SUM, None, True)  # async_op by position: no yield
        work.wait()  # a handle's wait: handed back until the next forward
        assert not phases.holding
        _step(model)
    finally:
        torch_collectives.uninstall()
    assert _kinds(session)[3:] == [("release", 1, False), ("acquire", 1), ("release", 1, False), ("acquire", 1),
                                   ("release", 1, True), ("acquire", 2)]
    assert dist.all_reduce is before and dist.distributed_c10d.all_reduce is before
