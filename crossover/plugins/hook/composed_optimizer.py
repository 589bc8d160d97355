"""The base of the plugin's own optimizers: a wrapper that *is* the user's optimizer as far as the outside sees.

It shares the wrapped optimizer's ``param_groups`` list and ``state``, so
learning-rate schedulers, ``state_dict()`` and checkpoints see one optimizer;
subclasses (:class:`~crossover.plugins.aggregation.adasum.optimizer.AdasumOptimizer`,
:class:`~crossover.plugins.aggregation.group_async.optimizer.GroupAsyncOptimizer`) add how
a step combines ranks.
"""
from __future__ import annotations

from typing import Any

import torch

from crossover.plugins.aggregation.selection import AggregationError

__all__ = ["ComposedOptimizer"]


class ComposedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` by composition; parameter groups added later go to the wrapped one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise AggregationError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._inner = optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_inner", None) is None:  # called from Optimizer.__init__
            super().add_param_group(param_group)
            return
        self._inner.add_param_group(param_group)  # appends to the shared list

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)
        self.share_inner_state()

    def share_inner_state(self) -> None:
        """Share the wrapped optimizer's ``param_groups`` and ``state`` again: loading a state into it
        (here, or Horovod's ``broadcast_optimizer_state`` on it) replaces both objects."""
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
