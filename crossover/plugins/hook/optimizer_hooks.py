"""One ordered chain of hooks on an optimizer: phase tracking, LB-BSP and the quiet wait plug into it.

:func:`hooks_of` gives an optimizer its :class:`HookChain` (made on first use):
the chain replaces the optimizer's ``step``, ``synchronize`` and ``zero_grad``
once, by bound methods (``types.MethodType``, so ``torch.optim.lr_scheduler``
can still wrap ``step``: it needs ``step.__func__``), and registers one
gradient hook per parameter while some hook wants gradients.

A hook may want gradients only at times (an outranked rank's yield check):
between backward passes (when it is added, and at every ``step()``) the chain
asks each hook that has ``on_gradient`` whether it wants the next pass's
gradients (:meth:`OptimizerHook.between_passes`), and registers the
per-parameter hooks, or removes them, accordingly. A pass that no hook wants
the gradients of costs no per-parameter call.

The end of a backward pass costs one hook, not one per parameter: the chain
watches every parameter's accumulation until one pass has reached them all,
then keeps a hook on the parameter accumulated last only (the sentinel), whose
pass ends when autograd's current graph task does. A ``step()`` that comes
without the sentinel having fired since the last one (the graph changed, or no
backward ran) sends the chain back to watching every parameter.

Order: a hook added later wraps the ones added before it, as a wrapper put
on the method later would. Before a call, every hook's ``before_*`` runs from
the outermost in; after it, every ``after_*`` runs from the innermost out,
told whether the call raised, as a ``finally`` would be. A hook whose ``before_*`` raised has not entered: only
the hooks before it get their ``after_*``. An exception in an ``after_*``
reaches the hooks outside it as ``raised=True`` and then the caller.

The chain is the one place that counts the optimizer's steps (:attr:`HookChain.steps`):
hooks read it, none keeps its own.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch

__all__ = ["HookChain", "OptimizerHook", "hooks_of"]


class OptimizerHook:
    """One plug-in of a :class:`HookChain`; every point does nothing unless a subclass overrides it."""

    def before_step(self) -> None:
        """``step()`` is called."""

    def after_step(self, raised: bool) -> None:
        """``step()`` returned (``raised`` False) or raised; ``chain.steps`` still counts the steps before it."""

    def before_synchronize(self) -> None:
        """``synchronize()`` is called (by the script, or by the optimizer's own ``step()``)."""

    def after_synchronize(self, raised: bool) -> None:
        """``synchronize()`` returned or raised."""

    def before_zero_grad(self) -> None:
        """``zero_grad()`` is called."""

    def between_passes(self) -> bool:
        """Between backward passes (when added, and at each ``step()``): whether ``on_gradient`` runs in the next.

        A hook may also add or remove hooks of its own outside the optimizer here (never inside a pass).
        """
        return True

    def on_gradient(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """A parameter's gradient is ready, before it is accumulated (autograd's thread).

        ``index`` counts the optimizer's parameters that require a gradient. Return
        a tensor to replace the gradient, or ``None`` to keep it.
        """
        return None

    def on_backward_done(self) -> None:
        """A backward pass has accumulated this optimizer's gradients into ``.grad`` (autograd's thread)."""


def _overrides(hook: OptimizerHook, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(OptimizerHook, name)


class HookChain:
    """The hooks of one optimizer, in order, and the count of its steps."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.hooks: list[OptimizerHook] = []  # outermost first
        self.steps = 0  # completed step() calls: the optimizer's iteration index
        self.params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
        self._gradient_hooks: list[OptimizerHook] = []  # the hooks that override on_gradient, in the order added
        self._wanting: tuple[OptimizerHook, ...] = ()  # those that want this pass's gradients
        self._per_parameter: list[Any] = []  # handles of the gradient hooks now registered, one per parameter
        self._backward_hooks: list[OptimizerHook] = []
        self._watched: list[Any] = []  # handles of the post-accumulate hooks now registered
        self._unfired: set[int] = set()  # watching all: the parameters (ids) this pass has not reached yet
        self._sentinel: Optional[torch.Tensor] = None  # the parameter whose accumulation ends a pass
        self._sentinel_fired = False  # since the last step()
        self._wrap()

    def add(self, hook: OptimizerHook) -> None:
        """Put ``hook`` around the hooks added so far and register the gradient hooks it needs."""
        self.hooks.insert(0, hook)
        if _overrides(hook, "on_gradient"):
            self._gradient_hooks.append(hook)
            self._ask_gradient_hooks()
        if _overrides(hook, "on_backward_done"):
            if not self._backward_hooks and self.params:
                self._watch_all()
            self._backward_hooks.append(hook)

    def _wrap(self) -> None:
        opt, chain = self.opt, self
        original_step, original_sync, original_zero_grad = opt.step, opt.synchronize, opt.zero_grad

        def step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            if chain._gradient_hooks:
                chain._ask_gradient_hooks()
            if chain._backward_hooks:
                chain._next_iteration()
            out = chain._around("step", original_step, args, kwargs)
            chain.steps += 1
            return out

        def synchronize(_opt: Any) -> Any:
            return chain._around("synchronize", original_sync, (), {})

        def zero_grad(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            for hook in list(chain.hooks):
                hook.before_zero_grad()
            return original_zero_grad(*args, **kwargs)

        opt.step = types.MethodType(step, opt)
        opt.synchronize = types.MethodType(synchronize, opt)
        opt.zero_grad = types.MethodType(zero_grad, opt)

    def _around(self, point: str, original: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        entered: list[OptimizerHook] = []
        try:
            for hook in list(self.hooks):
                getattr(hook, f"before_{point}")()
                entered.append(hook)
            out = original(*args, **kwargs)
        except BaseException:
            self._exit(point, entered, raised=True)
            raise
        self._exit(point, entered, raised=False)
        return out

    @staticmethod
    def _exit(point: str, entered: list[OptimizerHook], raised: bool) -> None:
        for position in range(len(entered) - 1, -1, -1):
            try:
                getattr(entered[position], f"after_{point}")(raised)
            except BaseException:
                HookChain._exit(point, entered[:position], raised=True)
                raise

    def _ask_gradient_hooks(self) -> None:
        """Between passes: which hooks want the next pass's gradients; the per-parameter hooks follow."""
        self._wanting = tuple(hook for hook in self._gradient_hooks if hook.between_passes())
        if self._wanting and not self._per_parameter:
            self._per_parameter = [param.register_hook(functools.partial(self._on_gradient, index))
                                   for index, param in enumerate(self.params)]
        elif not self._wanting and self._per_parameter:
            for handle in self._per_parameter:
                handle.remove()
            self._per_parameter = []

    def _on_gradient(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        replaced: Optional[torch.Tensor] = None
        for hook in self._wanting:  # in the order they were added, as torch runs hooks
            out = hook.on_gradient(index, grad if replaced is None else replaced)
            if out is not None:
                replaced = out
        return replaced

    def _next_iteration(self) -> None:
        """Between passes (hooks are changed here, never inside one): learn, keep or drop the sentinel."""
        if self._sentinel is None:
            self._unfired = {id(p) for p in self.params}
        elif not self._sentinel_fired:
            self._watch_all()
        elif len(self._watched) > 1:
            self._unwatch()
            self._watched = [self._sentinel.register_post_accumulate_grad_hook(self._on_sentinel_accumulated)]
        self._sentinel_fired = False

    def _unwatch(self) -> None:
        for handle in self._watched:
            handle.remove()
        self._watched = []

    def _watch_all(self) -> None:
        self._unwatch()
        self._sentinel = None
        self._unfired = {id(p) for p in self.params}
        self._watched = [p.register_post_accumulate_grad_hook(self._on_any_accumulated) for p in self.params]

    def _on_any_accumulated(self, param: torch.Tensor) -> None:
        if self._sentinel is not None:  # learned in this step; the other hooks go at the next step()
            if param is self._sentinel:
                self._on_sentinel_accumulated(param)
            return
        self._unfired.discard(id(param))
        if self._unfired:
            return
        self._sentinel = param
        self._sentinel_fired = True
        self._backward_done()

    def _on_sentinel_accumulated(self, param: torch.Tensor) -> None:
        self._sentinel_fired = True
        # Should another parameter come later in this pass (another graph order), the graph task's end is later still.
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        for hook in self._backward_hooks:
            hook.on_backward_done()


def hooks_of(opt: Any) -> HookChain:
    """The optimizer's hook chain, made (and its methods wrapped) on first use."""
    chain = getattr(opt, "_crossover_hooks", None)
    if chain is None:
        chain = HookChain(opt)
        opt._crossover_hooks = chain
    return chain
