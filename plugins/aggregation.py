"""How a job's gradients are combined: ``average``, ``sum``, ``adasum`` or ``weighted`` (LB-BSP).

The rule comes from ``CROSSOVER_AGGREGATION`` or from :func:`set_aggregation`
(which wins). Without either, nothing changes: Horovod does what the script
asked for. The Horovod hook (:mod:`crossover.plugins.horovod_torch`) builds
every ``hvd.DistributedOptimizer`` through :func:`distributed_optimizer`;
a script that does not use ``import crossover.auto`` can call
:func:`DistributedOptimizer` from this module instead.

Rules
-----
``average`` / ``sum``
    Horovod's own optimizer with ``op=hvd.Average`` / ``op=hvd.Sum``.

``adasum``
    Adasum (Maleki et al., MLSys 2021) of the optimizer *deltas*, as Horovod
    does it: each rank applies the wrapped optimizer locally (learning rate,
    momentum, weight decay), the deltas ``p_after - p_before`` are combined
    per tensor with the Adasum tree, and every rank sets ``p = p_before +
    combined delta``. Two implementations, chosen by :func:`adasum_path`:

    * **native** — ``op=hvd.Adasum``: Horovod's C++ kernel (vector halving,
      distance doubling; about 2× the model bytes sent per rank, overlapped
      with the backward pass because each tensor is reduced as soon as its
      gradient is ready). Only under the MPI controller, on the global
      process set and with a power-of-two number of ranks (on GPUs with
      NCCL: a power-of-two number of nodes).
    * **plugin** — :class:`AdasumOptimizer`: :mod:`crossover.plugins.adasum`
      over Horovod collectives (:class:`HorovodCollectives`), so it runs
      under Gloo, inside a process set and with any number of ranks. The
      reduction starts in ``step()`` (no overlap with backward) and is one
      fused call per dtype. Data moved per rank and step, for a model of
      ``M`` bytes over ``n`` ranks: ``allgather`` receives ``(n-1)·M`` and
      holds ``n`` copies, in one collective call; ``recursive_doubling``
      sends and receives about ``⌈log2 n⌉·M`` (plus ``M`` twice for ranks
      folded into a power of two) in ``log2(p)+2`` ``alltoall`` rounds.
      ``auto`` picks ``allgather`` up to 8 ranks.

``weighted``
    LB-BSP (Chen et al., SoCC 2020): rank ``i`` trains on ``b_i`` samples of
    each global batch of ``B = Σ b_i`` (the sampler from
    :func:`batch_sampler`) and the update is ``Σ (b_i / B)·g_i``, the mean
    gradient over all ``B`` samples. We keep Horovod's optimizer with
    ``op=hvd.Average`` and scale each rank's gradient by ``b_i·n/B`` in a
    tensor hook that runs *before* the gradient is accumulated and handed
    to Horovod's allreduce: ``(1/n)·Σ b_i·n/B·g_i = Σ (b_i/B)·g_i``. We do
    not use ``op=hvd.Sum`` with a per-rank ``prescale_factor = b_i/B``
    because ``DistributedOptimizer`` derives its prescale factor from the
    one, global ``gradient_predivide_factor``; the Average route keeps that
    option, fp16 compression and Horovod's tensor fusion and overlap as
    they are. The gradients must be means over the rank's batch (the
    default ``reduction="mean"`` of PyTorch losses).

    Every ``period`` steps all ranks share their per-step compute times
    (from the last ``zero_grad()`` since the previous ``step()``, or from
    that step when there was none, to the start of this step's
    synchronisation: forward and backward, without evaluation or logging
    done between steps) with one
    ``hvd.allgather_async`` of a small float64 tensor, started after the
    boundary step and read two steps later (its latency hides behind
    those steps; one step with ``period`` 1), feed the same list to their own
    :class:`~crossover.plugins.batch_size.BatchSizeController` (speed
    estimates and proposals), and so all adopt the same new sizes for the
    same following global batch. A proposal is adopted only when it passes
    the controller's size hysteresis *and* promises an iteration shorter by
    at least ``CROSSOVER_LBBSP_MIN_GAIN`` and by more than the measurements'
    scatter (:func:`decide`), so that a job without stragglers does not chase
    measurement noise. A tensor
    allgather is used rather than ``hvd.allgather_object`` because the
    latter has no ``process_set`` argument in Horovod 0.28. The first step
    is not measured (one-off start-up costs), and the controller leaves out
    each rank's next ``CROSSOVER_LBBSP_WARMUP`` measurements: in the
    benchmark, first decisions made from the first four steps went wrong in
    two runs of six, one giving a healthy rank 5 samples of 256.

Threads: the gradient hooks run on the autograd thread (the training thread
on CPU, a device thread on CUDA); they only pop from a ``deque`` that the
sampler appends to on the training thread, and touch per-step state that
``step()`` resets after the backward pass has finished.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import threading
import time
import types
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch

from ..client.settings import (
    ADASUM_ALGORITHMS,
    ADASUM_IMPLS,
    AGGREGATION_RULES,
    LBBSP_METHODS,
    AggregationSettings,
)
from .adasum import AdasumAlgorithm, adasum_allreduce_tensors
from .batch_size import BatchSizeConfig, BatchSizeController, Measurement
from .sampler import WeightedBatchSampler

__all__ = [
    "AdasumDecision",
    "AdasumFacts",
    "AdasumOptimizer",
    "AggregationError",
    "DistributedOptimizer",
    "HorovodCollectives",
    "LBBSPSampler",
    "Rule",
    "adasum_path",
    "aggregation_of",
    "apply_measurements",
    "batch_sampler",
    "decide",
    "current_rule",
    "distributed_optimizer",
    "lbbsp_stats",
    "replay_decisions",
    "resolve_algorithm",
    "set_aggregation",
    "weight_scale",
]

logger = logging.getLogger(__name__)

Rule = Literal["average", "sum", "adasum", "weighted"]
_AUTO_ALLGATHER_MAX_RANKS = 8


class AggregationError(ValueError):
    """The requested aggregation cannot be applied as asked (the message says why and what to do)."""


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

_selected: dict[str, Optional[str]] = {"rule": None, "adasum_impl": None, "adasum_algorithm": None}


def set_aggregation(
    rule: Optional[str], *, adasum_impl: Optional[str] = None, adasum_algorithm: Optional[str] = None
) -> None:
    """Select the aggregation rule in code; it wins over ``CROSSOVER_AGGREGATION``.

    Affects optimizers built afterwards. ``rule=None`` goes back to the
    environment (and so, by default, to Horovod's own behaviour).
    ``adasum_impl`` (``auto|native|plugin``) and ``adasum_algorithm``
    (``auto|allgather|recursive_doubling``) override their variables likewise.
    """
    if rule is not None and rule not in AGGREGATION_RULES:
        raise AggregationError(f"unknown aggregation rule {rule!r}; use one of {', '.join(AGGREGATION_RULES)}")
    if adasum_impl is not None and adasum_impl not in ADASUM_IMPLS:
        raise AggregationError(f"unknown adasum_impl {adasum_impl!r}; use one of {', '.join(ADASUM_IMPLS)}")
    if adasum_algorithm is not None and adasum_algorithm not in ADASUM_ALGORITHMS:
        raise AggregationError(
            f"unknown adasum_algorithm {adasum_algorithm!r}; use one of {', '.join(ADASUM_ALGORITHMS)}"
        )
    _selected.update(rule=rule, adasum_impl=adasum_impl, adasum_algorithm=adasum_algorithm)


def _settings() -> AggregationSettings:
    """Environment settings with the in-code selection applied on top."""
    env = AggregationSettings.from_env()
    changes = {key: value for key, value in _selected.items() if value is not None}
    if not changes:
        return env
    fields = {**env.__dict__, **changes}
    return AggregationSettings(**fields)


def current_rule() -> Optional[str]:
    """The rule new optimizers get, or ``None`` for Horovod's own behaviour."""
    return _settings().rule or None


# ---------------------------------------------------------------------------
# Pure decisions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AdasumFacts:
    """What decides whether Horovod's native Adasum can run this optimizer.

    Attributes:
        size: ranks that combine gradients (the process set's size).
        global_set: whether the optimizer uses Horovod's global process set.
        mpi_enabled: ``hvd.mpi_enabled()``: the MPI controller runs (Horovod
            registers its Adasum operation only then; under Gloo it raises
            "No Adasum operation enabled").
        cuda: parameters live on a GPU.
        nccl_built: ``hvd.nccl_built()``: GPU Adasum is then hierarchical
            (NCCL averaging inside a node, Adasum across nodes).
        local_size: ranks on this node.
        homogeneous: ``hvd.is_homogeneous()``: every node has as many ranks.
    """

    size: int
    global_set: bool
    mpi_enabled: bool
    cuda: bool = False
    nccl_built: bool = False
    local_size: int = 1
    homogeneous: bool = True


@dataclass(frozen=True)
class AdasumDecision:
    """Which Adasum implementation runs, and why (logged once per optimizer)."""

    path: Literal["native", "plugin"]
    reason: str


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def adasum_path(facts: AdasumFacts, impl: str = "auto") -> AdasumDecision:
    """Choose native or plugin Adasum; ``impl="native"`` raises where native cannot run."""
    if impl not in ADASUM_IMPLS:
        raise AggregationError(f"unknown adasum_impl {impl!r}; use one of {', '.join(ADASUM_IMPLS)}")
    blocker = None
    if not facts.mpi_enabled:
        blocker = "Horovod's Adasum needs the MPI controller (horovodrun --mpi / mpirun); this job runs without it"
    elif not facts.global_set:
        blocker = "Horovod's Adasum does not support process sets"
    elif facts.cuda and facts.nccl_built:  # hierarchical: NCCL inside a node, Adasum across nodes
        nodes, rest = divmod(facts.size, max(1, facts.local_size))
        if rest or not facts.homogeneous or not _power_of_two(nodes):
            blocker = (f"Horovod's GPU Adasum needs a power-of-two number of equally sized nodes, "
                       f"got {facts.size} ranks with {facts.local_size} on this node")
    elif not _power_of_two(facts.size):
        blocker = f"Horovod's Adasum needs a power-of-two number of ranks, this group has {facts.size}"
    if facts.size == 1:
        blocker = None  # Horovod then builds a plain optimizer; nothing to combine
    if impl == "plugin":
        return AdasumDecision("plugin", "CROSSOVER_ADASUM_IMPL=plugin")
    if blocker is None:
        return AdasumDecision("native", "MPI controller, global process set, power-of-two ranks")
    if impl == "native":
        raise AggregationError(f"{blocker}; unset CROSSOVER_ADASUM_IMPL (or use 'auto') to run the plugin's Adasum")
    return AdasumDecision("plugin", blocker)


def resolve_algorithm(algorithm: str, size: int) -> AdasumAlgorithm:
    """``auto`` → ``allgather`` up to 8 ranks, ``recursive_doubling`` beyond."""
    if algorithm == "auto":
        return "allgather" if size <= _AUTO_ALLGATHER_MAX_RANKS else "recursive_doubling"
    if algorithm in ("allgather", "recursive_doubling"):
        return algorithm  # type: ignore[return-value]
    raise AggregationError(f"unknown Adasum algorithm {algorithm!r}; use one of {', '.join(ADASUM_ALGORITHMS)}")


def weight_scale(batch: int, global_batch: int, group_size: int) -> float:
    """Factor applied to a rank's mean gradient before an Average allreduce.

    ``b_i·n/B``: averaging the scaled gradients over ``n`` ranks gives
    ``Σ (b_i/B)·g_i``.
    """
    if global_batch < 1 or batch < 0 or group_size < 1:
        raise AggregationError(
            f"invalid weighting inputs: batch {batch}, global batch {global_batch}, {group_size} ranks"
        )
    return batch * group_size / global_batch


# ---------------------------------------------------------------------------
# Horovod collectives for the plugin's Adasum
# ---------------------------------------------------------------------------


class HorovodCollectives:
    """:class:`~crossover.plugins.adasum.PairwiseCollectives` over Horovod, in one process set.

    ``allgather`` is one ``hvd.allgather`` of the tensor with a leading dim
    of 1; ``exchange`` is one ``hvd.alltoall`` whose splits are non-zero only
    towards ``send_to``. A rank that sends nothing still needs the dtype of
    the round: :meth:`expect` sets it (the plugin optimizer calls it for each
    fusion group). Every rank of the set must make the same calls in the same
    order; the op names count calls, so they match across ranks.
    """

    def __init__(self, hvd: Any, process_set: Any = None, *, name: str = "crossover.adasum") -> None:
        self._hvd = hvd
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._name = name
        self._calls = 0
        self._dtype = torch.float32
        self._device = torch.device("cpu")

    @property
    def process_set(self) -> Any:
        return self._process_set

    @property
    def rank(self) -> int:
        return int(self._process_set.rank())

    @property
    def size(self) -> int:
        return int(self._process_set.size())

    def expect(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        """Dtype (and device) of the next exchanges, for ranks that only receive or idle."""
        self._dtype = dtype
        self._device = device if device is not None else torch.device("cpu")

    def _next_name(self, kind: str) -> str:
        self._calls += 1
        return f"{self._name}.{kind}.{self._calls}"

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = self._hvd.allgather(
            tensor.reshape(1, -1).contiguous(), name=self._next_name("allgather"), process_set=self._process_set
        )
        return gathered.reshape(self.size, *tensor.shape)

    def exchange(
        self, tensor: Optional[torch.Tensor], send_to: Optional[int], recv_from: Optional[int]
    ) -> Optional[torch.Tensor]:
        size = self.size
        splits = torch.zeros(size, dtype=torch.int32)
        if tensor is not None and send_to is not None:
            data = tensor.reshape(-1).contiguous()
            splits[send_to] = data.numel()
        else:
            data = torch.empty(0, dtype=self._dtype, device=self._device)
        received, counts = self._hvd.alltoall(
            data, splits=splits, name=self._next_name("exchange"), process_set=self._process_set
        )
        if recv_from is None:
            return None
        counts = [int(c) for c in counts]
        if sum(counts) != counts[recv_from]:
            raise AggregationError(f"Adasum exchange: expected data only from rank {recv_from}, got splits {counts}")
        return received


# ---------------------------------------------------------------------------
# Plugin Adasum optimizer
# ---------------------------------------------------------------------------


class AdasumOptimizer(torch.optim.Optimizer):
    """Delta-based Adasum over :class:`HorovodCollectives` (the plugin path).

    Wraps the user's optimizer by composition: it shares the wrapped
    optimizer's ``param_groups`` list and ``state``, so learning-rate
    schedulers, ``state_dict()`` and checkpoints see one optimizer. Each
    ``step()``: apply the wrapped optimizer locally, take the deltas, and
    :meth:`synchronize` Adasum-combines them (one fused collective per dtype)
    and sets ``p = p_before + combined``, as Horovod's
    ``_DistributedAdasumOptimizer`` does. Gradients accumulate over
    ``backward_passes_per_step`` passes as usual, since the reduction only
    happens in ``step()``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        collectives: HorovodCollectives,
        *,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        algorithm: AdasumAlgorithm = "allgather",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise AggregationError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if backward_passes_per_step < 1:
            raise AggregationError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share the list and the state, not copies (see the class docstring).
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._inner = optimizer
        self._collectives = collectives
        self._compression = compression
        self._algorithm = algorithm
        self.backward_passes_per_step = backward_passes_per_step
        self._pending: Optional[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def algorithm(self) -> AdasumAlgorithm:
        return self._algorithm

    def __repr__(self) -> str:
        return f"AdasumOptimizer({self._inner!r}, algorithm={self._algorithm})"

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            self._inner.step()
            deltas = [p.detach() - start for p, start in zip(params, starts)]
        self._pending = (params, starts, deltas)
        self.synchronize()
        return loss

    def synchronize(self) -> None:
        """Combine the pending deltas across ranks and apply them; a no-op when none are pending.

        Unlike Horovod's averaging optimizer there is nothing to wait for
        before ``step()``: the deltas only exist once the local step ran.
        """
        if self._pending is None:
            return
        params, starts, deltas = self._pending
        self._pending = None
        compression = self._compression
        if compression is not None:
            pairs = [compression.compress(delta) for delta in deltas]
            sent = [pair[0] for pair in pairs]
        else:
            pairs, sent = [], deltas
        reduced = self._reduce(sent)
        with torch.no_grad():
            for index, (param, start) in enumerate(zip(params, starts)):
                combined = reduced[index]
                if compression is not None:
                    combined = compression.decompress(combined, pairs[index][1])
                param.copy_(start + combined.to(start.dtype))

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, tensor in enumerate(tensors):
            groups.setdefault((tensor.dtype, tensor.device), []).append(index)
        out: list[Optional[torch.Tensor]] = [None] * len(tensors)
        # Same order on every rank: dicts keep insertion order and every rank
        # has the same parameters in the same order.
        for (dtype, device), indices in groups.items():
            self._collectives.expect(dtype, device)
            results = adasum_allreduce_tensors(
                [tensors[i] for i in indices], self._collectives, algorithm=self._algorithm
            )
            for index, result in zip(indices, results):
                out[index] = result
        return [tensor for tensor in out if tensor is not None]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AggregationError("skip_synchronize() is not supported with Adasum (Horovod's Adasum optimizer "
                               "does not support it either): call step() without synchronize()")
        yield  # pragma: no cover - unreachable, makes this a generator

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending is not None:
            raise AggregationError("zero_grad() between step()'s local update and synchronize() would lose the "
                                   "update; let step() finish first")
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_inner", None) is None:  # called from Optimizer.__init__
            super().add_param_group(param_group)
            return
        self._inner.add_param_group(param_group)  # appends to the shared list

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state


# ---------------------------------------------------------------------------
# LB-BSP: sampler, shared state, weighting hooks
# ---------------------------------------------------------------------------


@dataclass
class _LBBSP:
    """Per-process LB-BSP state shared by the sampler and the weighted optimizer."""

    controller: BatchSizeController
    rank: int
    world_size: int
    dataset_length: int
    min_gain: float = 0.1
    # The adopted assignment: what the sampler hands out. The controller only
    # estimates speeds and proposes; :func:`decide` adopts.
    sizes: tuple[int, ...] = ()
    # (this rank's batch, global batch) of every batch the sampler has handed
    # out and no backward pass has consumed yet; appended on the training
    # thread, popped by gradient hooks.
    pending: collections.deque[tuple[int, int]] = field(default_factory=lambda: collections.deque(maxlen=1024))
    history: list[tuple[int, list[int]]] = field(default_factory=list)  # (first step, sizes)
    # The first _TRACE_STEPS steps' shared measurements, [step][rank] = (batch, compute seconds):
    # what every rank's controller saw, so a run can be replayed offline against another rule.
    trace: list[list[tuple[int, float]]] = field(default_factory=list)
    overhead_s: float = 0.0
    compute_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        self.sizes = tuple(self.controller.sizes)
        self.history.append((0, list(self.sizes)))


_lbbsp: dict[str, Optional[_LBBSP]] = {"state": None}


class LBBSPSampler:
    """``DataLoader(batch_sampler=...)`` for LB-BSP: this rank's slice of every global batch.

    A thin wrapper around :class:`~crossover.plugins.sampler.WeightedBatchSampler`
    fed by the adopted LB-BSP sizes; it also records each batch's
    ``(b_i, B)`` so the weighted optimizer scales the gradient of exactly
    the batch that produced it, even when a DataLoader with workers draws
    indices ahead. Under any rule other than ``weighted`` the sizes never
    change, so the sampler is then a plain even split of each global batch.
    """

    def __init__(self, state: _LBBSP, *, shuffle: bool, seed: int, drop_last: bool) -> None:
        self._state = state
        self._inner = WeightedBatchSampler(
            state.dataset_length, state.rank, state.world_size, lambda: state.sizes,
            shuffle=shuffle, seed=seed, drop_last=drop_last,
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The current per-rank batch sizes."""
        return self._state.sizes

    @property
    def controller(self) -> BatchSizeController:
        return self._state.controller

    @property
    def epoch(self) -> int:
        return self._inner.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``; call it on every rank before each epoch."""
        self._inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[list[int]]:
        state = self._state
        state.pending.clear()  # batches of an abandoned iteration will never be trained on
        position = 0
        for indices in self._inner:
            # The inner sampler read state.sizes just before yielding and
            # nothing ran in between, so this is the split of this very batch.
            batch_total = min(sum(state.sizes), state.dataset_length - position)
            position += batch_total
            state.pending.append((len(indices), batch_total))
            yield indices


def batch_sampler(
    dataset_length: int,
    global_batch: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    initial_sizes: Optional[Sequence[int]] = None,
    min_batch: int = 1,
    max_batch: Optional[Sequence[int] | int] = None,
    period: Optional[int] = None,
    method: Optional[str] = None,
    hysteresis: Optional[float] = None,
    ema_alpha: Optional[float] = None,
    min_gain: Optional[float] = None,
    warmup: Optional[int] = None,
    process_set: Any = None,
) -> LBBSPSampler:
    """The one change an LB-BSP script makes: ``DataLoader(ds, batch_sampler=batch_sampler(len(ds), B))``.

    Call it after ``hvd.init()`` on every rank of the optimizer's process set,
    with the same arguments. ``global_batch`` is ``B``; sizes start even (or
    at ``initial_sizes``) and, under the ``weighted`` rule, follow the
    controller. Unset controller settings come from the ``CROSSOVER_LBBSP_*``
    variables. The newest sampler is the one the weighted optimizer follows.
    """
    import horovod.torch as hvd

    pset = process_set if process_set is not None else hvd.global_process_set
    settings = _settings()
    caps: Optional[Sequence[int] | int] = max_batch
    if caps is None and settings.lbbsp_max_batch:
        env_caps = settings.lbbsp_max_batch
        caps = env_caps[0] if len(env_caps) == 1 else tuple(env_caps)
    method_name = method or settings.lbbsp_method
    if method_name not in LBBSP_METHODS:
        raise AggregationError(f"unknown LB-BSP method {method_name!r}; use one of {', '.join(LBBSP_METHODS)}")
    config = BatchSizeConfig(
        global_batch=global_batch,
        world_size=int(pset.size()),
        min_batch=min_batch,
        max_batch=caps if caps is None or isinstance(caps, int) else tuple(caps),
        period=period if period is not None else settings.lbbsp_period,
        hysteresis=hysteresis if hysteresis is not None else settings.lbbsp_hysteresis,
        ema_alpha=ema_alpha if ema_alpha is not None else settings.lbbsp_ema_alpha,
        method=method_name,  # type: ignore[arg-type]
        warmup=warmup if warmup is not None else settings.lbbsp_warmup,
    )
    state = _LBBSP(
        controller=BatchSizeController(config, initial_sizes),
        rank=int(pset.rank()),
        world_size=int(pset.size()),
        dataset_length=dataset_length,
        min_gain=min_gain if min_gain is not None else settings.lbbsp_min_gain,
    )
    _lbbsp["state"] = state
    return LBBSPSampler(state, shuffle=shuffle, seed=seed, drop_last=drop_last)


def lbbsp_stats() -> Optional[dict[str, Any]]:
    """Sizes, their history and the controller's cost so far (``None`` before :func:`batch_sampler`).

    ``overhead_s`` is the time spent in the weighting hooks and at controller
    boundaries (measurement exchange and decision), ``step_s`` the wall time
    of the steps it was measured over, so ``overhead_s / step_s`` is the
    controller's share of training time. ``trace`` holds what the ranks
    shared of their first 5000 steps, ``[step][rank] = [batch, compute
    seconds]`` (seconds NaN where a step was not measured), in the order the
    controller saw them, for replaying a run offline.
    """
    state = _lbbsp["state"]
    if state is None:
        return None
    return {
        "sizes": list(state.sizes),
        "history": [[iteration, list(sizes)] for iteration, sizes in state.history],
        "speeds": list(state.controller.speeds),
        "steps": state.steps,
        "overhead_s": state.overhead_s,
        "compute_s": state.compute_s,
        "step_s": state.step_s,
        "trace": [[list(entry) for entry in step] for step in state.trace],
        "config": dataclasses.asdict(state.controller.config),
        "min_gain": state.min_gain,
    }


_SHARE_LAG = 2  # steps between starting the measurement allgather and reading it
_TRACE_STEPS = 5000  # steps of shared measurements kept for lbbsp_stats()["trace"]
_aggregator_ids = itertools.count()  # same sequence on every rank: all build the same optimizers in order


def _share_starts(iteration: int, period: int) -> bool:
    """Every rank starts the measurement exchange after the last step of a period."""
    return (iteration + 1) % period == 0


def _share_read_after(started: int, period: int) -> int:
    """The step after which the exchange started after step ``started`` is read (and decided on)."""
    return started + min(_SHARE_LAG, period)


class _WeightedAggregator:
    """Adds LB-BSP weighting and measurement to one Horovod averaging optimizer.

    Instance-level ``step``/``synchronize`` wrappers are bound methods
    (``types.MethodType``), so ``torch.optim.lr_scheduler`` can still wrap
    ``optimizer.step`` (it needs ``step.__func__``).
    """

    def __init__(self, hvd: Any, opt: Any, process_set: Any) -> None:
        self._hvd = hvd
        self._opt = opt
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._size = int(self._process_set.size())
        self._rank = int(self._process_set.rank())
        self._iteration = 0
        self._seen: set[int] = set()
        self._scale = 1.0
        self._step_batch = 0
        self._compute_start: Optional[float] = None  # last zero_grad() since the previous step
        self._compute_end: Optional[float] = None
        self._last_step_end = time.perf_counter()
        self._buffer: list[tuple[int, int, float]] = []  # (iteration, batch, compute seconds)
        self._hook_seconds = 0.0
        self._warned = False
        self._inflight: Any = None  # handle of the measurement allgather started at the last boundary
        self._share_started = 0  # the iteration after which it was started
        self._instance = next(_aggregator_ids)

    def attach(self) -> None:
        opt = self._opt
        original_step = opt.step
        original_sync = opt.synchronize
        original_zero_grad = opt.zero_grad
        aggregator = self

        def zero_grad(_self: Any, *args: Any, **kwargs: Any) -> Any:
            aggregator._compute_start = time.perf_counter()
            return original_zero_grad(*args, **kwargs)

        def synchronize(_self: Any) -> Any:
            aggregator._mark_compute_end()
            return original_sync()

        def step(_self: Any, *args: Any, **kwargs: Any) -> Any:
            aggregator._mark_compute_end()
            out = original_step(*args, **kwargs)
            aggregator._after_step()
            return out

        opt.synchronize = types.MethodType(synchronize, opt)
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(zero_grad, opt)
        index = 0
        for group in opt.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    param.register_hook(functools.partial(self._on_grad, index))
                    index += 1

    # -- gradient hooks (autograd thread) --------------------------------

    def _on_grad(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        if index in self._seen or not self._seen:  # first gradient of a backward pass
            self._seen.clear()
            self._begin_pass()
        self._seen.add(index)
        scale = self._scale
        return None if scale == 1.0 else grad * scale

    def _begin_pass(self) -> None:
        started = time.perf_counter()
        state = _lbbsp["state"]
        if state is None:
            self._warn_once("CROSSOVER_AGGREGATION=weighted without crossover.plugins.aggregation.batch_sampler(): "
                            "every rank weighs 1/n, i.e. plain averaging")
            self._scale = 1.0
        else:
            if state.pending:
                batch, total = state.pending.popleft()
            else:
                self._warn_once("a backward pass ran on a batch that the LB-BSP sampler did not hand out; "
                                "weighting it with the current sizes")
                sizes = state.sizes
                batch, total = sizes[self._rank], sum(sizes)
            self._scale = weight_scale(batch, total, self._size)
            self._step_batch += batch
        self._hook_seconds += time.perf_counter() - started

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(message)

    # -- step boundary (training thread) ----------------------------------

    def _mark_compute_end(self) -> None:
        if self._compute_end is None:
            self._compute_end = time.perf_counter()

    def _after_step(self) -> None:
        started = time.perf_counter()
        compute_end = self._compute_end if self._compute_end is not None else started
        compute_start = self._compute_start if self._compute_start is not None else self._last_step_end
        compute = compute_end - compute_start
        iteration = self._iteration
        # Iteration 0 includes one-off costs (allocations, first collective); keep it out of the speeds.
        seconds = compute if iteration > 0 and self._step_batch > 0 and compute > 0 else math.nan
        self._buffer.append((iteration, self._step_batch, seconds))
        state = _lbbsp["state"]
        if state is not None:
            if state.world_size != self._size:
                raise AggregationError(f"the LB-BSP sampler was built for {state.world_size} ranks, the optimizer "
                                       f"combines {self._size}; pass the optimizer's process_set to batch_sampler()")
            period = state.controller.config.period
            if self._inflight is not None and iteration >= _share_read_after(self._share_started, period):
                self._finish_share(state)
            if _share_starts(iteration, period):
                self._start_share()
        else:
            self._buffer.clear()
        self._iteration += 1
        self._seen.clear()
        self._step_batch = 0
        self._compute_start = None
        self._compute_end = None
        ended = time.perf_counter()
        if state is not None:
            state.steps += 1
            state.compute_s += 0.0 if math.isnan(seconds) else seconds
            state.step_s += ended - self._last_step_end
            state.overhead_s += (ended - started) + self._hook_seconds
        self._hook_seconds = 0.0
        self._last_step_end = ended

    # Cross-rank agreement: every rank starts the exchange after the same step
    # (a period boundary) and reads it _SHARE_LAG steps later (1 with period 1),
    # so all ranks feed identical measurement lists to identical controllers at
    # the same step and adopt the same sizes for the same next global batch.
    # Reading it later hides the allgather behind those steps' compute; with one
    # step, a loaded machine sometimes left it unfinished and the wait showed up
    # as controller overhead.

    def _start_share(self) -> None:
        local = torch.tensor(self._buffer, dtype=torch.float64).reshape(-1, 3)
        self._buffer.clear()
        self._share_started = self._iteration
        name = f"crossover.lbbsp.{self._instance}.{self._iteration}"
        self._inflight = self._hvd.allgather_async(local, name=name, process_set=self._process_set)
        _guard_shutdown(self)

    def _drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for a share that the loop will never read."""
        handle, self._inflight = self._inflight, None
        if handle is None:
            return
        deadline = time.monotonic() + timeout
        try:
            while not self._hvd.poll(handle):
                if time.monotonic() >= deadline:
                    logger.warning("LB-BSP measurement exchange still pending after %.0f s at shutdown; "
                                   "not waiting longer", timeout)
                    return
                time.sleep(0.001)
            self._hvd.synchronize(handle)
        except Exception as exc:  # at shutdown, a failed share must not mask the script's own outcome
            logger.debug("LB-BSP share still in flight at shutdown failed: %s", exc)

    def _finish_share(self, state: _LBBSP) -> None:
        gathered = self._hvd.synchronize(self._inflight)
        self._inflight = None
        steps = _steps(gathered.reshape(self._size, -1, 3).tolist())
        state.trace.extend(steps[:_TRACE_STEPS - len(state.trace)])
        _observe_steps(state.controller, steps)
        adopted = decide(state.controller, state.sizes, state.min_gain)
        if adopted is not None:
            state.sizes = tuple(adopted)
            state.history.append((self._iteration + 1, list(adopted)))
            logger.info("LB-BSP sizes from step %d: %s", self._iteration + 1, adopted)


# A share started at a job's last step is never read by the loop. If a fast
# rank then shut Horovod down (an explicit ``hvd.shutdown()`` or Horovod's
# own exit handler), a slower rank would submit its half to a dead Horovod and
# crash. So every rank first waits for its own in-flight share: that returns
# once all ranks have submitted theirs.
_DRAIN_TIMEOUT_S = 30.0
_pending: weakref.WeakSet[_WeightedAggregator] = weakref.WeakSet()
_shutdown_guard: dict[str, Any] = {"installed": False}


def _drain_pending() -> None:
    for aggregator in list(_pending):
        aggregator._drain(_DRAIN_TIMEOUT_S)
    _pending.clear()


def _guard_shutdown(aggregator: _WeightedAggregator) -> None:
    _pending.add(aggregator)
    if _shutdown_guard["installed"]:
        return
    _shutdown_guard["installed"] = True
    # atexit is LIFO: registered after hvd.init(), this runs before Horovod's own exit handler.
    atexit.register(_drain_pending)
    # ``hvd.shutdown`` is ``mpi_ops.shutdown``, which resets the torch handle table before it
    # calls the common shutdown: the drain must come before both, so both names are wrapped.
    hvd = aggregator._hvd
    for module in (hvd, getattr(hvd, "mpi_ops", None)):
        original = getattr(module, "shutdown", None)
        if module is not None and original is not None:
            module.shutdown = _draining(original)


def _draining(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(*args: Any, **kwargs: Any) -> Any:
        _drain_pending()
        return original(*args, **kwargs)

    return shutdown


def apply_measurements(controller: BatchSizeController, rows: Sequence[Sequence[Sequence[float]]]) -> None:
    """Feed gathered measurements to ``controller``'s estimates, iteration by iteration.

    ``rows[rank][k] = (iteration, batch, compute seconds)``; every rank lists
    the same iterations in the same order. Entries with no samples or no
    valid time (the first iteration, an empty batch) are left out.
    """
    _observe_steps(controller, _steps(rows))


def _steps(rows: Sequence[Sequence[Sequence[float]]]) -> list[list[tuple[int, float]]]:
    """``rows[rank][k] = (iteration, batch, seconds)`` turned around: per iteration, each rank's
    ``(batch, seconds)``, the form the controller reads and ``lbbsp_stats()["trace"]`` keeps."""
    return [[(int(row[column][1]), float(row[column][2])) for row in rows]
            for column in range(len(rows[0]) if rows else 0)]


def _observe_steps(controller: BatchSizeController, steps: Sequence[Sequence[Sequence[float]]]) -> None:
    for step in steps:
        controller.observe([Measurement(rank, int(batch), float(seconds)) for rank, (batch, seconds) in enumerate(step)
                            if batch >= 1 and math.isfinite(seconds) and seconds > 0])


def decide(controller: BatchSizeController, current: Sequence[int], min_gain: float) -> Optional[list[int]]:
    """The sizes to adopt at a period boundary, or ``None`` to keep ``current``.

    Adopts the controller's proposal only when (1) some rank's size moves by
    more than ``max(1, hysteresis × its size)`` (the controller's own
    hysteresis rule) and (2) the predicted iteration time (the slowest
    rank's predicted compute time) drops by at least ``min_gain`` even with
    cautious predictions (3): each rank's current time lowered and its new
    time raised by how far its prediction may be off (the bias and standard
    error of its recent times around its model, both robust to one-step
    hiccups, see :meth:`BatchSizeController.prediction_errors`). Rules 2 and 3 keep a homogeneous job
    from chasing measurement noise: with equal true speeds every noisy
    re-split makes the real slowest rank slower, so a re-split must promise a
    gain the measurements can vouch for.

    One exception to 2: when one rank is clearly the slowest (its current
    time lowered by its error exceeds every other rank's raised by theirs by
    ``min_gain``) and the proposal takes samples from it, its own new time is
    not asked to vouch for the gain: only the other ranks' cautious new times
    must stay ``min_gain`` below its cautious current time. Giving samples
    away never makes it slower, so with the others below it the move cannot
    lengthen the iteration; and its model is least trustworthy exactly
    there, below the batch sizes it has run (the ``ema`` line underrates how
    much faster a CPU straggler gets, and held it at a too-large batch in
    half of our benchmark runs). Pure: every rank gets the same answer from
    the same estimates.
    """
    proposal = controller.propose()
    if proposal is None or list(proposal) == list(current):
        return None
    hysteresis = controller.config.hysteresis
    if not any(abs(new - old) > max(1.0, hysteresis * old) for new, old in zip(proposal, current)):
        return None
    now, then = controller.predicted_times(current), controller.predicted_times(proposal)
    errors = controller.prediction_errors()
    if now is None or then is None or max(then) <= 0:
        return None
    if errors is not None:
        # Judge the move on cautious predictions: each rank's current time as short as
        # one standard error of its own scatter allows, its new time as long (the same
        # relative error). Equal ranks that only look unequal then promise nothing, while
        # a straggler far above its own scatter still moves; a bound on the largest error
        # of all ranks instead held a straggler back whenever its steps had hiccups.
        then = [t * (1.0 + e / n) for t, e, n in zip(then, errors, now)]
        high_now = [t + e for t, e in zip(now, errors)]
        now = [t - e for t, e in zip(now, errors)]
        slowest = max(range(len(now)), key=lambda r: (now[r], -r))
        others = [r for r in range(len(now)) if r != slowest]
        if others and proposal[slowest] < current[slowest] and \
                now[slowest] >= (1.0 + min_gain) * max(high_now[r] for r in others):
            then = [then[r] for r in others]
    return list(proposal) if max(now) >= (1.0 + min_gain) * max(then) else None


# ---------------------------------------------------------------------------
# Entry point for the hook
# ---------------------------------------------------------------------------

_reentry = threading.local()


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
    settings = _settings()
    if not settings.rule or getattr(_reentry, "active", False):
        return factory(optimizer, *args, **kwargs)
    _reentry.active = True
    try:
        return _build(hvd, factory, optimizer, args, kwargs, settings)
    finally:
        _reentry.active = False


def _build(hvd: Any, factory: Callable[..., Any], optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any],
           settings: AggregationSettings) -> Any:
    try:
        named = _bind(factory, optimizer, args, kwargs)
    except TypeError:
        return factory(optimizer, *args, **kwargs)  # let Horovod report the bad call its own way
    rule = settings.rule
    predivide = float(named.get("gradient_predivide_factor", 1.0))
    if predivide != 1.0 and rule != "average" and rule != "weighted":
        raise AggregationError(f"gradient_predivide_factor={predivide} only applies to averaging; remove it or "
                               f"use CROSSOVER_AGGREGATION=average instead of {rule}")
    pset = named.get("process_set")
    asked = named.get("op", hvd.Average)
    if pset is not None and callable(getattr(pset, "included", None)) and not pset.included():
        return factory(optimizer, **named)  # this rank combines nothing with this optimizer
    if rule in ("average", "sum"):
        named["op"] = hvd.Average if rule == "average" else hvd.Sum
        return _mark(factory(optimizer, **named), rule)
    if rule == "weighted":
        if asked not in (hvd.Average, None):
            logger.warning("CROSSOVER_AGGREGATION=weighted replaces the script's op with a weighted average")
        named["op"] = hvd.Average
        opt = factory(optimizer, **named)
        _WeightedAggregator(hvd, opt, pset).attach()
        return _mark(opt, "weighted")
    # adasum
    size = int(pset.size()) if pset is not None else int(hvd.size())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    facts = AdasumFacts(
        size=size, global_set=_is_global(hvd, pset), mpi_enabled=bool(hvd.mpi_enabled()),
        cuda=any(p.is_cuda for p in params), nccl_built=bool(hvd.nccl_built()), local_size=int(hvd.local_size()),
        homogeneous=_homogeneous(hvd),
    )
    decision = adasum_path(facts, settings.adasum_impl)
    if decision.path == "native":
        logger.info("adasum: Horovod's native Adasum (%s)", decision.reason)
        named["op"] = hvd.Adasum
        return _mark(factory(optimizer, **named), "adasum:native")
    algorithm = resolve_algorithm(settings.adasum_algorithm, size)
    logger.info("adasum: plugin Adasum, %s (%s)", algorithm, decision.reason)
    if named.get("groups") or named.get("num_groups"):
        logger.warning("adasum: the plugin's Adasum fuses all tensors of a dtype; 'groups' is ignored")
    opt = AdasumOptimizer(
        optimizer, HorovodCollectives(hvd, pset), compression=named.get("compression"),
        backward_passes_per_step=int(named.get("backward_passes_per_step", 1)), algorithm=algorithm,
    )
    return _mark(opt, f"adasum:plugin/{algorithm}")


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
    """``hvd.DistributedOptimizer`` with the selected rule, for scripts without ``import crossover.auto``."""
    import horovod.torch as hvd

    return distributed_optimizer(hvd, hvd.DistributedOptimizer, optimizer, args, kwargs)


def replay_decisions(config: BatchSizeConfig, trace: Sequence[Sequence[Sequence[float]]],
                     initial_sizes: Optional[Sequence[int]] = None,
                     min_gain: float = 0.1) -> list[tuple[int, list[int]]]:
    """The size history a job would adopt from ``trace`` (``lbbsp_stats()["trace"]``).

    Feeds the recorded measurements to a fresh controller on the plugin's own
    schedule (exchange after each period, read ``_SHARE_LAG`` steps later) and
    adopts with :func:`decide`, so with the recorded settings it reproduces
    the recorded ``history``; with other settings it answers "what would this
    rule have done on that run". Returns ``[(first step, sizes), ...]``.
    """
    controller = BatchSizeController(config, initial_sizes)
    sizes = list(controller.sizes)
    history = [(0, list(sizes))]

    def read(shared: list[Sequence[Sequence[float]]], iteration: int) -> None:
        nonlocal sizes
        _observe_steps(controller, shared)
        adopted = decide(controller, sizes, min_gain)
        if adopted is not None:
            sizes = adopted
            history.append((iteration + 1, list(adopted)))

    chunk: list[Sequence[Sequence[float]]] = []
    shared: Optional[list[Sequence[Sequence[float]]]] = None
    started = 0
    for iteration, row in enumerate(trace):
        chunk.append(row)
        if shared is not None and iteration >= _share_read_after(started, config.period):
            read(shared, iteration)
            shared = None
        if _share_starts(iteration, config.period):
            shared, chunk, started = chunk, [], iteration
    if shared is not None:  # the trace holds only exchanges that were read: this one was, after its end
        read(shared, _share_read_after(started, config.period))
    return history
