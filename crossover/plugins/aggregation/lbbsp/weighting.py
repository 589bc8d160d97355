"""LB-BSP on one Horovod averaging optimizer: weigh each rank's gradient, measure, share, adopt.

Every rank's gradient is scaled by ``b_i·n/B`` in a tensor hook that runs
*before* the gradient is accumulated and handed to Horovod's allreduce, so
``op=hvd.Average`` gives ``Σ (b_i/B)·g_i``. Every ``period`` steps the ranks
share their per-step compute times (from the last ``zero_grad()`` since the
previous ``step()``, or from that step when there was none, to the start of
this step's synchronisation) with one ``hvd.allgather_async`` of a small
float64 tensor, read on the schedule of :mod:`.exchange`, and adopt new sizes
with :func:`~.adoption.decide`.

Threads: the gradient hooks run on the autograd thread (the training thread
on CPU, a device thread on CUDA); they only pop from a ``deque`` that the
sampler appends to on the training thread, and touch per-step state that
the step's end resets after the backward pass has finished.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

import torch

from crossover.plugins.aggregation.lbbsp.adoption import decide
from crossover.plugins.aggregation.lbbsp.exchange import (
    guard_shutdown,
    observe_steps,
    share_read_after,
    share_starts,
    steps_of,
)
from crossover.plugins.aggregation.lbbsp.state import TRACE_STEPS, LBBSPState, SamplerLink
from crossover.plugins.aggregation.process_state import STATE
from crossover.plugins.aggregation.selection import AggregationError
from crossover.plugins.hook.optimizer_hooks import HookChain, OptimizerHook, hooks_of

__all__ = ["WeightingHook", "weight_scale"]

logger = logging.getLogger(__name__)



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


class WeightingHook(OptimizerHook):
    """Adds LB-BSP weighting and measurement to one Horovod averaging optimizer, following ``link``'s sampler."""

    def __init__(self, hvd: Any, opt: Any, process_set: Any, link: SamplerLink) -> None:
        self.hvd = hvd
        self._opt = opt
        self._link = link
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._size = int(self._process_set.size())
        self._rank = int(self._process_set.rank())
        self._chain: Optional[HookChain] = None
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
        self._instance = next(STATE.hook_ids)

    def attach(self) -> None:
        """Join the optimizer's hook chain."""
        self._chain = hooks_of(self._opt)
        self._chain.add(self)

    @property
    def _iteration(self) -> int:
        """The optimizer's step being finished (its chain counts them)."""
        assert self._chain is not None, "attach() first"
        return self._chain.steps

    # -- optimizer points (training thread) --------------------------------

    def before_zero_grad(self) -> None:
        self._compute_start = time.perf_counter()

    def before_synchronize(self) -> None:
        self._mark_compute_end()

    def before_step(self) -> None:
        self._mark_compute_end()

    def after_step(self, raised: bool) -> None:
        if not raised:
            self._after_step()

    # -- gradient hooks (autograd thread) --------------------------------

    def on_gradient(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        if index in self._seen or not self._seen:  # first gradient of a backward pass
            self._seen.clear()
            self._begin_pass()
        self._seen.add(index)
        scale = self._scale
        return None if scale == 1.0 else grad * scale

    def _begin_pass(self) -> None:
        started = time.perf_counter()
        state = self._link.state
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
        state = self._link.state
        if state is not None:
            if state.world_size != self._size:
                raise AggregationError(f"the LB-BSP sampler was built for {state.world_size} ranks, the optimizer "
                                       f"combines {self._size}; pass the optimizer's process_set to batch_sampler()")
            period = state.controller.config.period
            if self._inflight is not None and iteration >= share_read_after(self._share_started, period):
                self._finish_share(state)
            if share_starts(iteration, period):
                self._start_share()
        else:
            self._buffer.clear()
        self._seen.clear()
        self._step_batch = 0
        self._compute_start = None
        self._compute_end = None
        ended = time.perf_counter()
        if state is not None:
            state.steps += 1
            state.compute_s += 0.0 if math.isnan(seconds) else seconds
            state.step_s += ended - compute_start  # from zero_grad(): pauses between steps are no step
            state.overhead_s += (ended - started) + self._hook_seconds
        self._hook_seconds = 0.0
        self._last_step_end = ended

    def _start_share(self) -> None:
        local = torch.tensor(self._buffer, dtype=torch.float64).reshape(-1, 3)
        self._buffer.clear()
        self._share_started = self._iteration
        name = f"crossover.lbbsp.{self._instance}.{self._iteration}"
        self._inflight = self.hvd.allgather_async(local, name=name, process_set=self._process_set)
        guard_shutdown(self)

    def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for a share that the loop will never read."""
        handle, self._inflight = self._inflight, None
        if handle is None:
            return
        deadline = time.monotonic() + timeout
        try:
            while not self.hvd.poll(handle):
                if time.monotonic() >= deadline:
                    logger.warning("LB-BSP measurement exchange still pending after %.0f s at shutdown; "
                                   "not waiting longer", timeout)
                    return
                time.sleep(0.001)
            self.hvd.synchronize(handle)
        except Exception as exc:  # at shutdown, a failed share must not mask the script's own outcome
            logger.debug("LB-BSP share still in flight at shutdown failed: %s", exc)

    def _finish_share(self, state: LBBSPState) -> None:
        gathered = self.hvd.synchronize(self._inflight)
        self._inflight = None
        steps = steps_of(gathered.reshape(self._size, -1, 3).tolist())
        state.trace.extend(steps[:TRACE_STEPS - len(state.trace)])
        observe_steps(state.controller, steps)
        adopted = decide(state.controller, state.sizes, state.min_gain)
        if adopted is not None:
            state.sizes = tuple(adopted)
            state.history.append((self._iteration + 1, list(adopted)))
            logger.info("LB-BSP sizes from step %d: %s", self._iteration + 1, adopted)
