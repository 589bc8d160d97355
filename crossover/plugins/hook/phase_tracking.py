"""An optimizer's phase points, reported to the rank's `PhaseReporter` through the optimizer's hook chain.

Phase brackets, per optimizer (docs/plugin.md, "Phases"):
  * comm: around Horovod's `synchronize()` (for Horovod's Adasum optimizer,
    whose `synchronize()` is a no-op, around `step()`);
  * compute: a grant is requested as soon as comm ends (before the update) or
    at `zero_grad()` when not yet held (first iteration), and released when the
    last gradient of the step has been accumulated and the device work is
    complete (a CUDA event on GPUs), or at the latest on entering comm;
  * every other wait for peers (a metric allreduce, a broadcast, `join`, ...)
    frees the device for its length (`horovod_waits`).

Nothing here changes gradients, parameters or Horovod's calls.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from crossover.client.rank.session import Session
from crossover.plugins.hook.cuda_memory import use_cuda_memory
from crossover.plugins.hook.cuda_turns import CudaUnavailable, RunAhead, torch_cuda_turns, wait_for_device
from crossover.plugins.hook.host_staging import StagedHandle
from crossover.plugins.hook.optimizer_hooks import OptimizerHook, hooks_of
from crossover.plugins.hook.phase_reporter import PhaseReporter

__all__ = ["GradientYields", "cuda_index", "follow_outranked", "on_gpu", "pace_on_gpu", "remove_forward_boundaries",
           "track_phases", "use_cuda_turns"]

_log = logging.getLogger(__name__)

_POLL_MIN_S, _POLL_MAX_S = 50e-6, 250e-6


def track_phases(opt: Any, phases: PhaseReporter, quiet_wait: bool = True) -> None:
    """Report ``opt``'s phase points to ``phases`` (the rank's one reporter)."""
    _PhaseTracker(opt, phases, quiet_wait=quiet_wait).attach()


def cuda_index(params: Iterable[Any]) -> int | None:
    """The CUDA device of the first of `params` on one, or None when all are on the CPU."""
    return next((int(p.device.index or 0) for p in params if p.is_cuda), None)


def on_gpu(phases: PhaseReporter, index: int) -> None:
    """A rank that trains on CUDA device `index`, whichever front end: each release waits for its device, its
    turns end on the device where the driver can, its allocator is capped as the daemon says, and an
    outranked holder keeps little work queued ahead."""
    phases.settle = wait_for_device
    use_cuda_turns(phases)
    use_cuda_memory(phases.session, index)
    pace_on_gpu(phases)


def use_cuda_turns(phases: PhaseReporter) -> None:
    """End this rank's turns on its GPU where the driver can (`cuda_turns`); else its CPU keeps waiting."""
    session = phases.session
    if not isinstance(session, Session) or not session.settings.handover or session.turns.device is not None:
        return
    try:
        session.use_device(torch_cuda_turns())
    except CudaUnavailable as exc:
        _log.info("crossover: turns end on the CPU, not the GPU (%s)", exc)


def pace_on_gpu(phases: PhaseReporter) -> None:
    """On a GPU, an outranked holder keeps at most two layers queued ahead (`RunAhead`) at every boundary, so
    that a yield frees the GPU within about a layer."""
    if phases.pace is None:
        phases.pace = RunAhead()


def follow_outranked(phases: PhaseReporter) -> None:
    """While a higher class shares the device, every module's forward is a boundary too (a global forward
    pre-hook); otherwise no hook is there, so a rank nobody outranks (and a compiled model) never meets it."""
    outranked = phases.session.outranked
    if outranked and phases.forward_hook is None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        phases.forward_hook = register_module_forward_pre_hook(lambda _module, _args: phases.at_boundary())
    elif not outranked and phases.forward_hook is not None:
        remove_forward_boundaries(phases)


def remove_forward_boundaries(phases: PhaseReporter) -> None:
    """Take the forward pre-hook `follow_outranked` put on every module back out (also the plugin's uninstall)."""
    if phases.forward_hook is not None:
        phases.forward_hook.remove()
        phases.forward_hook = None


def _wait_quietly(opt: Any) -> None:
    """Sleep until every allreduce the optimizer has submitted is done, then let Horovod collect them.

    Horovod 0.28's ``synchronize()`` keeps the calling thread busy while it
    waits; on a CPU device that steals the core from the job whose turn it is
    to compute. Polling with sleeps (50 µs, doubling to 250 µs) hands the core
    back. Only when every gradient already has its own submitted handle:
    otherwise Horovod still has to submit some (or a group is incomplete),
    and its own wait is the only safe one.
    """
    from horovod.torch.mpi_ops import poll

    handles = getattr(opt, "_handles", None)
    needed = getattr(opt, "_requires_update", None)
    if not handles or needed is None:
        return
    covered: set[Any] = set()
    for key, (handle, _ctx) in handles.items():
        if not isinstance(handle, (int, StagedHandle)):
            return
        covered.update(key if isinstance(key, tuple) else (key,))
    if not needed <= covered:
        return
    pause = _POLL_MIN_S
    for handle, _ctx in list(handles.values()):
        while not poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)


class _QuietWait(OptimizerHook):
    """Inside the comm bracket, before Horovod's own wait: `_wait_quietly` while the device is shared."""

    def __init__(self, opt: Any, phases: PhaseReporter) -> None:
        self.opt = opt
        self.phases = phases

    def before_synchronize(self) -> None:
        if self.phases.session.shares_device:  # alone, nobody needs the core
            _wait_quietly(self.opt)


class GradientYields:
    """Yields at gradients, only while a higher class shares the device: the rule both front ends' trackers
    follow (Horovod's optimizer hook, `_PhaseTracker`, and DDP's module tracker, `ddp_torch`), which call
    ``between_passes`` between backward passes and ``on_gradient`` at each gradient while it said so."""

    phases: PhaseReporter

    def between_passes(self) -> bool:
        """The check at each gradient runs only while a higher class shares the device (and, on a GPU, so does
        the forward pre-hook): a rank nobody can ask to yield pays nothing per parameter."""
        if self.phases.pace is not None:  # on a GPU
            follow_outranked(self.phases)
        session = self.phases.session
        outranked = session.outranked
        if not outranked:
            session.preempted = False  # asked while nobody could: not to be honoured a pass later
        return outranked

    def on_gradient(self, index: int, grad: Any) -> None:
        phases = self.phases
        if phases.pace is not None or phases.session.preempted:  # flag reads, unless there is work
            phases.at_boundary()
        return None


class _PhaseTracker(GradientYields, OptimizerHook):
    """One optimizer's phase points, reported to the rank's shared `PhaseReporter`."""

    def __init__(self, opt: Any, phases: PhaseReporter, quiet_wait: bool = True) -> None:
        self.opt = opt
        self.phases = phases
        self.quiet_wait = quiet_wait
        self.passes = 0  # backward passes done in this compute phase
        self._comm_start = 0.0
        self._chain = hooks_of(opt)
        self.expected = max(1, int(getattr(opt, "backward_passes_per_step", 1)))
        cuda = cuda_index(self._chain.params)
        if cuda is not None:
            on_gpu(phases, cuda)
        # Horovod's Adasum optimizer's synchronize() is a no-op: step() waits on the allreduce.
        import horovod.torch.optimizer as hvd_opt  # only a Horovod optimizer gets here

        self._adasum = isinstance(opt, getattr(hvd_opt, "_DistributedAdasumOptimizer", ()))

    def attach(self) -> None:
        self.phases.on_phase_start.append(self._new_phase)
        chain = self._chain
        if self.quiet_wait and not self._adasum:
            chain.add(_QuietWait(self.opt, self.phases))  # inside the comm bracket
        chain.add(self)

    def _comm_begin(self) -> None:
        self.phases.comm_begin()
        self._comm_start = time.perf_counter()

    def _comm_end(self) -> None:
        self.phases.comm_end(time.perf_counter() - self._comm_start)

    def before_step(self) -> None:
        if self._adasum:
            self._comm_begin()

    def after_step(self, raised: bool) -> None:
        if self._adasum:
            self._comm_end()
        elif not raised:
            self.phases.ensure_holding()

    def before_synchronize(self) -> None:
        if not self._adasum:
            self._comm_begin()

    def after_synchronize(self, raised: bool) -> None:
        if not self._adasum:
            self._comm_end()

    def before_zero_grad(self) -> None:
        self.phases.ensure_holding()

    def _new_phase(self) -> None:
        self.passes = 0

    def on_backward_done(self) -> None:
        self.passes += 1
        if self.passes >= self.expected:
            self.phases.compute_done()
