"""LB-BSP weighting on one rank: the sampler's bookkeeping and the optimizer's hooks."""
from __future__ import annotations

import torch
import torch.nn as nn

from crossover.plugins import aggregation
from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.lbbsp.state import LBBSPState
from crossover.plugins.aggregation.lbbsp.weighting import WeightingHook
from crossover.plugins.aggregation.process_state import STATE
from tests.unit.plugins._aggregation_fixtures import FakeHvd, _clean  # noqa: F401

# --- weighted: sampler bookkeeping and hooks on one rank -----------------------


def _state(sizes: list[int], length: int, period: int = 2, rank: int = 0) -> LBBSPState:
    config = BatchSizeConfig(global_batch=sum(sizes), world_size=len(sizes), period=period, hysteresis=0.0)
    state = LBBSPState(BatchSizeController(config, sizes), rank, len(sizes), length)
    STATE.lbbsp.state = state
    return state


def test_sampler_records_each_batch_split_including_the_remainder():
    state = _state([3, 5], length=20)
    sampler = aggregation.LBBSPSampler(state, shuffle=False, seed=0, drop_last=False)
    batches = list(sampler)
    assert [len(b) for b in batches] == [3, 3, 2]  # 8 + 8 + a remainder of 4 split 2/2
    assert list(state.pending) == [(3, 8), (3, 8), (2, 4)]
    iterator = iter(sampler)
    next(iterator)
    assert list(state.pending) == [(3, 8)]  # a new epoch forgets batches never trained on


def test_sampler_through_a_dataloader_sees_size_changes_between_batches():
    state = _state([4, 4], length=32, rank=1)
    sampler = aggregation.LBBSPSampler(state, shuffle=True, seed=3, drop_last=True)
    loader = torch.utils.data.DataLoader(torch.arange(32), batch_sampler=sampler)
    lengths = []
    for index, batch in enumerate(loader):
        lengths.append(len(batch))
        if index == 0:
            state.sizes = (6, 2)  # as an adoption between two steps would
    assert lengths == [4, 2, 2, 2]


class RecordingSGD(torch.optim.SGD):
    """Stands for Horovod's averaging optimizer on one rank: keeps the gradients it would allreduce."""

    def synchronize(self) -> None:
        self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def test_weighted_hooks_scale_gradients_and_decide_at_boundaries():
    hvd = FakeHvd(size=1)
    model = nn.Linear(4, 1, bias=False)
    opt = RecordingSGD(model.parameters(), lr=0.0)
    state = _state([6], length=24, period=2)
    WeightingHook(hvd, opt, None, link=STATE.lbbsp).attach()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # needs step.__func__: bound-method patch
    state.pending.extend([(3, 12), (6, 6), (6, 6), (6, 6)])
    x = torch.ones(2, 4)
    for step in range(4):
        opt.zero_grad()
        model(x).sum().backward()
        opt.synchronize()
        opt.step()
        scheduler.step()
        if step == 0:
            assert torch.allclose(opt.seen[0], torch.full((1, 4), 2.0 * 0.25))  # scale b·n/B = 3·1/12
    assert not state.pending
    # exchanges start after steps 1 and 3 (period 2); the name ends with the step, the same on every rank
    assert [name.rsplit(".", 1)[1] for kind, name in hvd.calls] == ["1", "3"]
    assert state.steps == 4 and state.step_s > 0 and 0 < state.overhead_s < state.step_s
    assert state.controller.speeds[0] is not None  # measurements of steps 1 and 2 reached the controller
