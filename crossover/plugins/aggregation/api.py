"""What `crossover.plugins.aggregation` exports (the package loads this module on first use, so that the
parameter service, which needs only numpy, starts without torch): building a job's optimizer by its rule,
the LB-BSP sampler, and the rules' statistics. The package's ``__all__`` is the one list of what it exports;
names imported here ``as`` themselves are there only to be exported."""
from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from crossover.plugins.aggregation.adasum.collectives import HorovodCollectives
from crossover.plugins.aggregation.adasum.decision import AdasumDecision as AdasumDecision
from crossover.plugins.aggregation.adasum.decision import AdasumFacts, adasum_path, resolve_algorithm
from crossover.plugins.aggregation.adasum.optimizer import AdasumOptimizer
from crossover.plugins.aggregation.group_async.optimizer import GroupAsyncOptimizer
from crossover.plugins.aggregation.group_async.runtime import GroupRuntime
from crossover.plugins.aggregation.group_async.sampler import GroupSampler
from crossover.plugins.aggregation.lbbsp.adoption import decide as decide
from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.lbbsp.exchange import apply_measurements as apply_measurements
from crossover.plugins.aggregation.lbbsp.replay import replay_decisions as replay_decisions
from crossover.plugins.aggregation.lbbsp.sampler import LBBSPSampler
from crossover.plugins.aggregation.lbbsp.state import LBBSPState
from crossover.plugins.aggregation.lbbsp.weighting import WeightingHook
from crossover.plugins.aggregation.lbbsp.weighting import weight_scale as weight_scale
from crossover.plugins.aggregation.process_state import STATE
from crossover.plugins.aggregation.selection import AggregationError, settings
from crossover.plugins.aggregation.selection import Rule as Rule
from crossover.plugins.aggregation.selection import current_rule as current_rule
from crossover.plugins.aggregation.selection import set_aggregation as set_aggregation
from crossover.plugins.aggregation.selection import use_settings as use_settings
from crossover.plugins.hook import optimizer_state
from crossover.plugins.hook.composed_optimizer import ComposedOptimizer
from crossover.settings import LBBSP_METHODS, AggregationSettings, LBBSPSettings

logger = logging.getLogger(__name__)




def _group_runtime(hvd: Any, chosen: AggregationSettings) -> GroupRuntime:
    if STATE.group is None:
        STATE.group = GroupRuntime(hvd, chosen)
    return STATE.group


def group_async_stats() -> Optional[dict[str, Any]]:
    """Groups, stage, exchanges, the staleness (clock gap) histogram and the boundary history of this
    rank's group_async runtime (``None`` if there is none); on rank 0 also the service's own figures."""
    runtime = STATE.group
    return None if runtime is None else runtime.stats()


def end_group_async() -> None:
    """End group_async training on every rank together (call it on all of them): wait for all, mix the
    groups' models into the one final model every rank then holds, stop the service, and forget the
    runtime, so that a script training several models one after another starts each afresh. Horovod's
    shutdown does this by itself."""
    runtime, STATE.group = STATE.group, None
    if runtime is not None:
        runtime.finish()


def _bind(factory: Callable[..., Any], optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Horovod's arguments by name (positional ones included), without the optimizer."""
    signature = inspect.signature(factory)
    bound = signature.bind(optimizer, *args, **kwargs)
    named: dict[str, Any] = {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if index == 0:
            continue  # the optimizer
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise AggregationError("pass DistributedOptimizer's arguments after the optimizer by name")
        else:
            named[name] = value
    return named


def _is_global(hvd: Any, process_set: Any) -> bool:
    return process_set is None or process_set is hvd.global_process_set or getattr(
        process_set, "process_set_id", None) == 0


def _homogeneous(hvd: Any) -> bool:
    """``is_homogeneous()`` lives in ``horovod.torch.mpi_ops`` (not re-exported by ``horovod.torch``)."""
    check = getattr(hvd, "is_homogeneous", None) or getattr(getattr(hvd, "mpi_ops", None), "is_homogeneous", None)
    return bool(check()) if callable(check) else True


def _mark(opt: Any, description: str) -> Any:
    try:
        opt._crossover_aggregation = description
    except AttributeError:  # pragma: no cover - objects without a __dict__
        pass
    return opt


def aggregation_of(optimizer: Any) -> Optional[str]:
    """What :func:`distributed_optimizer` made of this optimizer, e.g. ``"adasum:plugin/allgather"``."""
    return getattr(optimizer, "_crossover_aggregation", None)


def distributed_optimizer(
    hvd: Any, factory: Callable[..., Any], optimizer: Any, args: Sequence[Any] = (),
    kwargs: Optional[dict[str, Any]] = None,
) -> Any:
    """Build ``hvd.DistributedOptimizer(optimizer, *args, **kwargs)`` with the selected rule.

    ``factory`` is Horovod's own ``DistributedOptimizer`` (the hook passes the
    original it wrapped). Without a rule this is exactly
    ``factory(optimizer, *args, **kwargs)``. Raises :class:`AggregationError`
    when the rule contradicts the script's arguments (for instance ``sum``
    with a ``gradient_predivide_factor``); Horovod's own errors pass through.
    A nested call (a factory that itself calls this function) passes through.
    """
    kwargs = dict(kwargs or {})
    chosen = settings()
    if not chosen.rule or getattr(STATE.building, "active", False):
        return factory(optimizer, *args, **kwargs)
    STATE.building.active = True
    try:
        built = _build(hvd, factory, optimizer, args, kwargs, chosen)
    finally:
        STATE.building.active = False
    if isinstance(built, ComposedOptimizer):
        optimizer_state.install()  # its state must be broadcast without stepping it on some ranks only
    return built


def _build(hvd: Any, factory: Callable[..., Any], optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any],
           chosen: AggregationSettings) -> Any:
    try:
        named = _bind(factory, optimizer, args, kwargs)
    except TypeError:
        return factory(optimizer, *args, **kwargs)  # let Horovod report the bad call its own way
    rule = chosen.rule
    predivide = float(named.get("gradient_predivide_factor", 1.0))
    if predivide != 1.0 and rule != "average" and rule != "weighted":
        raise AggregationError(f"gradient_predivide_factor={predivide} only applies to averaging; remove it or "
                               f"use CROSSOVER_AGGREGATION=average instead of {rule}")
    pset = named.get("process_set")
    if pset is not None and callable(getattr(pset, "included", None)) and not pset.included():
        return factory(optimizer, **named)  # this rank combines nothing with this optimizer
    return _RULES[rule](_Request(hvd, factory, optimizer, named, pset, chosen))


@dataclass(frozen=True)
class _Request:
    """What a rule's builder gets: Horovod, its own factory, the script's optimizer and its arguments by
    name, the process set they name (None: the global one) and the settings that chose the rule."""

    hvd: Any
    factory: Callable[..., Any]
    optimizer: Any
    named: dict[str, Any]
    pset: Any
    chosen: AggregationSettings


def _op_rule(req: _Request) -> Any:
    """``average`` and ``sum``: Horovod's own optimizer with that op."""
    rule = req.chosen.rule
    req.named["op"] = req.hvd.Average if rule == "average" else req.hvd.Sum
    return _mark(req.factory(req.optimizer, **req.named), str(rule))


def _weighted_rule(req: _Request) -> Any:
    """``weighted`` (LB-BSP): Horovod's averaging optimizer, gradients weighted by the batch sizes."""
    if req.named.get("op", req.hvd.Average) not in (req.hvd.Average, None):
        logger.warning("CROSSOVER_AGGREGATION=weighted replaces the script's op with a weighted average")
    req.named["op"] = req.hvd.Average
    opt = req.factory(req.optimizer, **req.named)
    WeightingHook(req.hvd, opt, req.pset, link=STATE.lbbsp).attach()
    return _mark(opt, "weighted")


def _adasum_rule(req: _Request) -> Any:
    """``adasum``: Horovod's native kernel where it can run, the plugin's AdasumOptimizer elsewhere."""
    hvd, pset, named, chosen = req.hvd, req.pset, req.named, req.chosen
    size = int(pset.size()) if pset is not None else int(hvd.size())
    params = [p for group in req.optimizer.param_groups for p in group["params"]]
    facts = AdasumFacts(
        size=size, global_set=_is_global(hvd, pset), mpi_enabled=bool(hvd.mpi_enabled()),
        cuda=any(p.is_cuda for p in params), nccl_built=bool(hvd.nccl_built()), local_size=int(hvd.local_size()),
        homogeneous=_homogeneous(hvd),
    )
    decision = adasum_path(facts, chosen.adasum_impl)
    if decision.path == "native":
        logger.info("adasum: Horovod's native Adasum (%s)", decision.reason)
        named["op"] = hvd.Adasum
        return _mark(req.factory(req.optimizer, **named), "adasum:native")
    algorithm = resolve_algorithm(chosen.adasum_algorithm, size)
    logger.info("adasum: plugin Adasum, %s (%s)", algorithm, decision.reason)
    if named.get("groups") or named.get("num_groups"):
        logger.warning("adasum: the plugin's Adasum fuses all tensors of a dtype; 'groups' is ignored")
    opt = AdasumOptimizer(
        req.optimizer, HorovodCollectives(hvd, pset), compression=named.get("compression"),
        backward_passes_per_step=int(named.get("backward_passes_per_step", 1)), algorithm=algorithm,
    )
    return _mark(opt, f"adasum:plugin/{algorithm}")


def _group_async_rule(req: _Request) -> Any:
    """``group_async``: synchronous inside groups of ranks, asynchronous between them."""
    if not _is_global(req.hvd, req.pset):
        raise AggregationError("group_async forms its own process sets; build the optimizer on the global one")
    grouped = GroupAsyncOptimizer(req.optimizer, req.hvd, _group_runtime(req.hvd, req.chosen))
    return _mark(grouped, f"group_async:{req.chosen.grouping}/{req.chosen.group_schedule}")


_RULES: dict[str, Callable[[_Request], Any]] = {
    "average": _op_rule, "sum": _op_rule, "weighted": _weighted_rule, "adasum": _adasum_rule,
    "group_async": _group_async_rule,
}
"""Each rule `CROSSOVER_AGGREGATION` names, and what builds its optimizer (as `crossover.daemon.policies`
names each policy)."""


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
    """``hvd.DistributedOptimizer`` with the selected rule, for scripts without ``import crossover.auto``."""
    import horovod.torch as hvd

    return distributed_optimizer(hvd, hvd.DistributedOptimizer, optimizer, args, kwargs)


def batch_sampler(
    dataset_length: int,
    global_batch: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    initial_sizes: Optional[Sequence[int]] = None,
    min_batch: int = 1,
    lbbsp: Optional[LBBSPSettings] = None,
    process_set: Any = None,
) -> LBBSPSampler | GroupSampler:
    """The one change an LB-BSP script makes: ``DataLoader(ds, batch_sampler=batch_sampler(len(ds), B))``.

    Call it after ``hvd.init()`` on every rank of the optimizer's process set,
    with the same arguments. ``global_batch`` is ``B``; sizes start even (or
    at ``initial_sizes``) and, under the ``weighted`` rule, follow the
    controller. ``lbbsp`` tunes the controller (period, method, hysteresis, EMA weight, minimum gain,
    warm-up, per-rank caps); without it, the ``CROSSOVER_LBBSP_*`` variables do. To change a few:
    ``dataclasses.replace(aggregation.settings().lbbsp, period=4)``. The newest sampler is the one the
    weighted optimizer follows.
    """
    import horovod.torch as hvd

    pset = process_set if process_set is not None else hvd.global_process_set
    chosen = settings()
    if chosen.rule == "group_async":
        return GroupSampler(_group_runtime(hvd, chosen), dataset_length, global_batch, shuffle=shuffle,
                            seed=seed)
    tuning = lbbsp if lbbsp is not None else chosen.lbbsp
    if tuning.method not in LBBSP_METHODS:
        raise AggregationError(f"unknown LB-BSP method {tuning.method!r}; use one of {', '.join(LBBSP_METHODS)}")
    caps = tuning.max_batch
    config = BatchSizeConfig(
        global_batch=global_batch,
        world_size=int(pset.size()),
        min_batch=min_batch,
        max_batch=(caps[0] if len(caps) == 1 else caps) if caps else None,
        period=tuning.period,
        hysteresis=tuning.hysteresis,
        ema_alpha=tuning.ema_alpha,
        method=tuning.method,  # type: ignore[arg-type]
        warmup=tuning.warmup,
    )
    state = LBBSPState(
        controller=BatchSizeController(config, initial_sizes),
        rank=int(pset.rank()),
        world_size=int(pset.size()),
        dataset_length=dataset_length,
        min_gain=tuning.min_gain,
    )
    STATE.lbbsp.state = state
    return LBBSPSampler(state, shuffle=shuffle, seed=seed, drop_last=drop_last)


def lbbsp_stats() -> Optional[dict[str, Any]]:
    """Sizes, their history and the controller's cost so far (``None`` before :func:`batch_sampler`).

    ``overhead_s`` is the time spent in the weighting hooks and at controller
    boundaries (measurement exchange and decision), ``step_s`` the wall time
    of the steps it was measured over (each from its ``zero_grad()``, so
    evaluations and other pauses between steps are left out), so
    ``overhead_s / step_s`` is the controller's share of training time. ``trace`` holds what the ranks
    shared of their first 5000 steps, ``[step][rank] = [batch, compute
    seconds]`` (seconds NaN where a step was not measured), in the order the
    controller saw them, for replaying a run offline.
    """
    state = STATE.lbbsp.state
    return None if state is None else state.stats()
