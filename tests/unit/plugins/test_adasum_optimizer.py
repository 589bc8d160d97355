"""The plugin's Adasum optimizer over threads (one per rank), against a sequential delta reference."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from fake_collectives import FakeCollectives, FakeGroup, run_ranks

from crossover.plugins.aggregation import AdasumOptimizer, AggregationError
from crossover.plugins.aggregation.adasum.algorithms import adasum_reference
from tests.unit.plugins._aggregation_fixtures import _clean, sgd  # noqa: F401

# --- plugin Adasum optimizer over threads -------------------------------------


def model_and_data(rank: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    gen = torch.Generator().manual_seed(10 + rank)
    data = [(torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(3)]
    return model, data


def reference_adasum_training(size: int) -> list[torch.Tensor]:
    """Sequential float64 simulation: local SGD+momentum steps per rank, deltas combined with the reference."""
    models, optims, datas = [], [], []
    for rank in range(size):
        model, data = model_and_data(rank)
        models.append(model)
        optims.append(sgd(model, lr=0.3))
        datas.append(data)
    common = [p.detach().clone() for p in models[0].parameters()]
    for step in range(3):
        deltas = []
        for model, opt, data in zip(models, optims, datas):
            with torch.no_grad():
                for p, c in zip(model.parameters(), common):
                    p.copy_(c)
            opt.zero_grad()
            x, y = data[step]
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            deltas.append([p.detach() - c for p, c in zip(model.parameters(), common)])
        common = [c + adasum_reference([d[i] for d in deltas]) for i, c in enumerate(common)]
    return common


@pytest.mark.parametrize("size", [2, 3, 8])
def test_plugin_adasum_optimizer_matches_the_delta_reference(size):
    prepared = [model_and_data(rank) for rank in range(size)]  # torch's RNG is global: seed outside the threads

    def body(coll: FakeCollectives) -> list[torch.Tensor]:
        model, data = prepared[coll.rank]
        opt = AdasumOptimizer(sgd(model, lr=0.3), coll)  # type: ignore[arg-type]
        for x, y in data:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    results, _ = run_ranks(size, body)
    expected = reference_adasum_training(size)
    for rank_params in results:
        for got, want in zip(rank_params, expected):
            assert float((got - want).norm() / want.norm()) <= 1e-12


def test_plugin_adasum_optimizer_is_one_optimizer_for_schedulers_and_checkpoints():
    model, data = model_and_data(0)
    inner = sgd(model, lr=0.5)
    opt = AdasumOptimizer(inner, FakeCollectives(FakeGroup(1), 0))  # type: ignore[arg-type]
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    x, y = data[0]
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"], "momentum buffers live in the wrapped optimizer's state"
    opt.load_state_dict(saved)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    with pytest.raises(AggregationError, match="skip_synchronize"):
        with opt.skip_synchronize():
            pass
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
