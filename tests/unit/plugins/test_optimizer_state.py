"""`broadcast_optimizer_state` for the plugin's own optimizers: the wrapped optimizer's state goes through
Horovod's function (whose empty-state step is then local), and group_async's record follows from the root."""
from __future__ import annotations

from typing import Any

import torch

from crossover.plugins.aggregation.group_async.optimizer import GroupAsyncOptimizer
from crossover.plugins.aggregation.group_async.runtime import GroupRuntime
from crossover.plugins.hook.optimizer_state import _broadcast_composed
from crossover.settings import AggregationSettings


class _Hvd:
    def __init__(self, rank: int, root_state: dict[str, Any]) -> None:
        self._rank, self.root_state, self.broadcasts = rank, root_state, []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 4

    def broadcast_object(self, obj: Any, root_rank: int, name: str = "") -> Any:
        self.broadcasts.append(name)
        return obj if self._rank == root_rank else self.root_state


def _grouped(hvd: _Hvd) -> tuple[GroupAsyncOptimizer, torch.optim.Optimizer]:
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    runtime = GroupRuntime(hvd, AggregationSettings(rule="group_async", groups="2", group_schedule="staged"))
    return GroupAsyncOptimizer(inner, hvd, runtime), inner


def test_the_wrapped_optimizer_is_broadcast_and_the_roots_group_state_is_loaded_before_training():
    root = GroupRuntime(_Hvd(0, {}), AggregationSettings(rule="group_async", groups="2", group_schedule="staged"))
    root.stage = root.schedule.stage = root.schedule.coarse  # not where a fresh runtime starts
    root._start_version, root._paces = 12, [1.0, 1.0, 2.0, 2.0]
    hvd = _Hvd(1, root.state_dict())
    opt, inner = _grouped(hvd)
    called = []

    def horovods(optimizer: Any, root_rank: int) -> None:  # what Horovod's function does to the optimizer
        called.append(optimizer)
        optimizer.load_state_dict(optimizer.state_dict())  # new state and param_groups objects

    _broadcast_composed(hvd, horovods, opt, 0)
    assert called == [inner]  # never the composed optimizer, whose step() is a collective
    assert opt.state is inner.state and opt.param_groups is inner.param_groups
    assert hvd.broadcasts == ["crossover.group_async.optimizer_state"]
    assert (opt.runtime.stage.name, opt.runtime._start_version, opt.runtime._paces) == ("coarse", 12,
                                                                                         [1.0, 1.0, 2.0, 2.0])

    opt.runtime.started = True  # later, training under way: the group state is the runtime's own business
    _broadcast_composed(hvd, horovods, opt, 0)
    assert hvd.broadcasts == ["crossover.group_async.optimizer_state"]


def test_the_optimizers_state_dict_carries_the_group_state_and_a_plain_one_still_loads():
    opt, inner = _grouped(_Hvd(0, {}))
    state = opt.state_dict()
    assert state["group_async"]["schedule"] == {"kind": "staged", "stage": "profile", "peak_rate": 0.0}
    plain = inner.state_dict()
    opt.load_state_dict(plain)  # a checkpoint of another rule: the group state starts afresh
    opt.load_state_dict(state)
    assert opt.runtime.stage.name == "profile"
