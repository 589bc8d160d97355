"""The group_async optimizer: synchronous data-parallel SGD inside the group, exchanges between groups.

``step()`` = :meth:`synchronize` (average the gradients over the group's
Horovod process set, weighted by each member's share of the group's batch;
the leader's flags, "exchange now" and "the epoch is used up", and each
member's pace ride along in the same grouped allreduce, so the group agrees
without another round trip; then, if flagged, the exchange with the
parameter service) followed by the wrapped
optimizer's update. The exchange happens inside ``synchronize()``, which the
phase tracker brackets as communication: a rank never holds its device while
its group waits on the service. The gradients, computed on the model before
the exchange, are applied to the model after it, as asynchronous SGD does.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from crossover.plugins.aggregation.group_async.runtime import GroupRuntime
from crossover.plugins.aggregation.selection import AggregationError
from crossover.plugins.hook.composed_optimizer import ComposedOptimizer

__all__ = ["GroupAsyncOptimizer"]


class GroupAsyncOptimizer(ComposedOptimizer):
    """Wraps the user's optimizer by composition (:class:`ComposedOptimizer`); parameter groups must be
    complete before wrapping, since the runtime flattens the parameters once."""

    def __init__(self, optimizer: torch.optim.Optimizer, hvd: Any, runtime: GroupRuntime) -> None:
        super().__init__(optimizer)
        self._hvd = hvd
        self.runtime = runtime
        runtime.params = [p for g in self.param_groups for p in g["params"]]
        self.backward_passes_per_step = 1
        self._synchronized = False
        self._compute_from: Optional[float] = None

    def __repr__(self) -> str:
        return f"GroupAsyncOptimizer({self._inner!r})"

    def synchronize(self) -> None:
        """Average gradients inside the group, then exchange with the service if the leader asked."""
        if self._synchronized:
            return
        if self._compute_from is not None:  # a boundary's wait is no compute
            self.runtime.observe(time.perf_counter() - max(self._compute_from, self.runtime.boundary_left))
        rt = self.runtime
        if not rt.started:  # no group_async sampler: the first step is the one boundary
            rt.begin_epoch(0, 0, 1)
        params = [p for p in rt.params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        exchange = over = False
        if rt.is_leader:
            exchange, over = rt.step_flags()
        else:
            rt.count_step()
        members = len(rt.group)
        if members > 1:
            # the leader's flags, then each member's pace in its own slot: one allreduce carries all
            extra = torch.zeros(1 + members)
            extra[0] = float(exchange) + 2.0 * float(over)
            extra[1 + rt.group.index(rt.rank)] = rt.member_pace()
            scale = rt.grad_scale()
            with torch.no_grad():
                if scale != 1.0:  # unequal shares: the average then weighs every sample alike
                    for p in params:
                        assert p.grad is not None
                        p.grad.mul_(scale)
            started = time.perf_counter()
            reduced = self._hvd.grouped_allreduce([p.grad for p in params] + [extra], op=self._hvd.Average,
                                                  process_set=rt.process_set(), name="crossover.group_async.grads")
            rt.costs["allreduce"].append(time.perf_counter() - started)
            with torch.no_grad():
                for p, r in zip(params, reduced):
                    assert p.grad is not None
                    p.grad.copy_(r)
            code = round(float(reduced[-1][0]) * members)  # only the leader's flags are non-zero
            exchange, over = bool(code & 1), bool(code & 2)
            rt.note_member_paces([float(v) * members for v in reduced[-1][1:]])
        rt.account.over = rt.account.over or over
        if exchange:
            rt.exchange()
        self._synchronized = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self._synchronized = False
        result = self._inner.step()
        self._compute_from = time.perf_counter()
        return loss if closure is not None else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        if self._compute_from is None:
            self._compute_from = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, and under ``"group_async"`` where group training stands
        (:meth:`GroupRuntime.state_dict`), so a checkpoint resumes both."""
        return {**self._inner.state_dict(), "group_async": self.runtime.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state from :meth:`state_dict`, or a plain optimizer's (group training then starts afresh)."""
        state = dict(state_dict)
        group_state = state.pop("group_async", None)
        super().load_state_dict(state)
        if group_state is not None:
            self.runtime.load_state_dict(group_state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_inner", None) is None:  # called from Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise AggregationError("group_async: add parameter groups before wrapping the optimizer")
