"""The optimizer's one hook chain: nesting order, exceptions, the step count and gradient hooks."""
from __future__ import annotations

from typing import Optional

import pytest

torch = pytest.importorskip("torch")
from crossover.plugins.hook.optimizer_hooks import OptimizerHook, hooks_of  # noqa: E402


class SyncSGD(torch.optim.SGD):
    """Stands for Horovod's optimizer: a synchronize() that step() calls."""

    fail = False

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("allreduce failed")

    def step(self, closure=None):  # type: ignore[override]
        self.synchronize()
        return super().step(closure)


class Recorder(OptimizerHook):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def before_step(self) -> None:
        self.log.append(f"{self.name}>step")

    def after_step(self, raised: bool) -> None:
        self.log.append(f"{self.name}<step{'!' if raised else ''}")

    def before_synchronize(self) -> None:
        self.log.append(f"{self.name}>sync")

    def after_synchronize(self, raised: bool) -> None:
        self.log.append(f"{self.name}<sync{'!' if raised else ''}")

    def before_zero_grad(self) -> None:
        self.log.append(f"{self.name}>zero")


def _opt() -> SyncSGD:
    return SyncSGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


def test_a_hook_added_later_wraps_the_earlier_ones():
    opt, log = _opt(), []
    chain = hooks_of(opt)
    chain.add(Recorder("inner", log))
    chain.add(Recorder("outer", log))
    assert hooks_of(opt) is chain
    opt.zero_grad()
    opt.step()
    assert log == ["outer>zero", "inner>zero", "outer>step", "inner>step", "outer>sync", "inner>sync",
                   "inner<sync", "outer<sync", "inner<step", "outer<step"]
    assert chain.steps == 1
    assert opt.step.__func__ is not None  # a bound method: LR schedulers can still wrap it


def test_a_failed_call_reaches_every_entered_hook_and_is_not_counted():
    opt, log = _opt(), []
    chain = hooks_of(opt)
    chain.add(Recorder("a", log))
    opt.fail = True
    with pytest.raises(RuntimeError, match="allreduce failed"):
        opt.step()
    assert log == ["a>step", "a>sync", "a<sync!", "a<step!"]
    assert chain.steps == 0


def test_a_hook_whose_before_raised_has_not_entered():
    class Refuses(OptimizerHook):
        def before_synchronize(self) -> None:
            raise ValueError("no")

    opt, log = _opt(), []
    chain = hooks_of(opt)
    chain.add(Refuses())
    chain.add(Recorder("outer", log))
    with pytest.raises(ValueError):
        opt.synchronize()
    assert log == ["outer>sync", "outer<sync!"]


def test_gradient_hooks_run_in_the_order_added_and_may_replace_the_gradient():
    class Scale(OptimizerHook):
        def __init__(self, factor: float) -> None:
            self.factor = factor

        def on_gradient(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
            return grad * self.factor

    class Seen(OptimizerHook):
        def __init__(self) -> None:
            self.grads: list[torch.Tensor] = []

        def on_backward_done(self) -> None:
            self.grads.append(param.grad.clone())

    param = torch.nn.Parameter(torch.ones(2))
    opt = SyncSGD([param], lr=0.1)
    seen = Seen()
    chain = hooks_of(opt)
    chain.add(Scale(2.0))
    chain.add(Scale(3.0))
    chain.add(seen)
    (param * 1.0).sum().backward()
    torch.testing.assert_close(param.grad, torch.full((2,), 6.0))
    torch.testing.assert_close(seen.grads[0], torch.full((2,), 6.0))


class PassCounter(OptimizerHook):
    """Notes, at each backward_done, how many of the model's parameters already have a gradient."""

    def __init__(self, params: list) -> None:
        self.params, self.seen = params, []

    def on_backward_done(self) -> None:
        self.seen.append(sum(p.grad is not None for p in self.params))


def _mlp(layers: int = 5):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


def _watched(chain) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in chain.params)


def _counted(model):
    """An optimizer over `model` whose chain counts passes; (optimizer, its parameters, counter, chain)."""
    opt = SyncSGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    counter = PassCounter(params)
    chain = hooks_of(opt)
    chain.add(counter)
    return opt, params, counter, chain


def test_backward_done_comes_once_per_pass_after_every_gradient_and_then_costs_one_hook():
    model = _mlp()
    opt, params, counter, chain = _counted(model)
    assert _watched(chain) == len(params)  # learning: every parameter
    for it in range(4):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        assert counter.seen == [len(params)] * (it + 1)
        opt.step()
        assert _watched(chain) == 1  # from the first step on: the sentinel alone


def test_a_step_without_the_sentinel_goes_back_to_watching_every_parameter():
    model = _mlp()
    opt, params, counter, chain = _counted(model)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    assert _watched(chain) == 1
    opt.zero_grad()
    opt.step()  # no backward: the sentinel did not fire
    assert _watched(chain) == len(params)
    # The graph changes: the last layer is skipped, so the old sentinel would never fire again.
    partial = torch.nn.Sequential(*list(model)[:-1])
    for _ in range(2):
        opt.zero_grad()
        partial(torch.ones(3, 4)).sum().backward()
        opt.step()
    # Learning never completes while a parameter gets no gradient: no pass end is reported (the
    # grant then goes back on entering comm, as the phase tracker's fallback), and all stay watched.
    assert counter.seen == [len(params)] * 2
    assert _watched(chain) == len(params)
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()  # the whole graph again: learned anew
    assert counter.seen == [len(params)] * 3
    opt.step()
    assert _watched(chain) == 1


def test_several_passes_per_step_each_end_once():
    model = _mlp(3)
    opt, _, counter, _ = _counted(model)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(2):  # backward_passes_per_step = 2
            model(torch.ones(3, 4)).sum().backward()
        opt.step()
    assert len(counter.seen) == 6


def test_a_hook_gets_gradients_only_in_passes_it_wants_them_and_costs_no_hook_otherwise():
    class Sometimes(OptimizerHook):
        def __init__(self) -> None:
            self.wanted, self.seen = False, 0

        def between_passes(self) -> bool:
            return self.wanted

        def on_gradient(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
            self.seen += 1
            return None

    model = _mlp(3)
    opt = SyncSGD(model.parameters(), lr=0.01)
    hook = Sometimes()
    hooks_of(opt).add(hook)

    def iteration() -> None:
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()

    def registered() -> int:
        return sum(len(p._backward_hooks or {}) for p in model.parameters())

    iteration()
    assert (hook.seen, registered()) == (0, 0)
    hook.wanted = True
    iteration()  # asked at this step(): the next pass has the hooks
    assert hook.seen == 0 and registered() == 6
    iteration()
    assert hook.seen == 6
    hook.wanted = False
    iteration()  # the pass before this step still had them
    assert hook.seen == 12 and registered() == 0
    iteration()
    assert hook.seen == 12
