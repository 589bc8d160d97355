"""Schedule a PyTorch `DistributedDataParallel` rank: compute from each forward to its backward's end.

The DDP front end of `import crossover.auto` (Horovod's is `horovod_torch`). When a
script builds its first `DistributedDataParallel`, the rank registers with its daemon
(its identity from torchrun, `torchrun_identity`) and each DDP module reports its
phase points to the rank's one `PhaseReporter`:

  * **compute** begins at a forward (a forward pre-hook asks for the device when it is
    not held) and ends when the backward has run every node, so every gradient bucket is
    ready and its allreduce launched: a callback queued on autograd's engine at the
    backward's first node runs then, before DDP's own end-of-backward work;
  * **communication** runs from there until DDP has waited for every bucket's allreduce
    and written the gradients back: a second engine callback, queued by the first, runs
    after DDP's, and asks for the device for the next iteration;
  * a forward under `no_sync()` or `torch.no_grad()` reduces nothing: its backward stays
    compute, as DDP's own accumulation does.

Why engine callbacks and not a communication hook (docs/plugin.md, "DDP"): a DDP module
takes one comm hook, which the script's own (fp16 compression, PowerSGD, ZeRO's overlap)
or DDP's mixed precision may already hold, and a hook replaces the reducer's own averaging,
so results would no longer be bit-identical to plain DDP. The callbacks change nothing
DDP computes and work alike with `no_sync`, `find_unused_parameters`, `static_graph` and
`gradient_as_bucket_view`.

While a higher class shares the device, a rank also yields at each gradient (one
post-accumulate hook per parameter, only then) and, on a GPU, at each module's forward;
other collectives free the device while they wait (`torch_collectives`). Every hook
swallows its own errors (logged): Crossover never breaks training.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any

from crossover.plugins.hook import torch_collectives
from crossover.plugins.hook.phase_reporter import PhaseReporter, guarded
from crossover.plugins.hook.phase_tracking import (
    GradientYields,
    cuda_index,
    on_gpu,
    remove_forward_boundaries,
)
from crossover.plugins.hook.rank_session import open_session
from crossover.plugins.hook.runtime import RUNTIME
from crossover.plugins.hook.torchrun_identity import job_id_from_env, place_from_env
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings

__all__ = ["install", "notice_fsdp", "uninstall"]

_log = logging.getLogger(__name__)

_DESTROY_S = 10.0  # the longest the exit waits for the process group to shut down
_STORE_KEY = "crossover/job_id"

_original_init: Any = None
_step_hook: Any = None


def install(settings: PluginSettings, ddp_module: Any = None) -> bool:
    """Hook `DistributedDataParallel` and `torch.distributed`'s waits; idempotent. False when disabled.

    ``ddp_module`` is `torch.nn.parallel.distributed`, given while torch's own import is still running
    (`import_watch`), when `torch.nn.parallel` cannot yet be imported from."""
    global _original_init
    if settings.disabled:
        return False
    if ddp_module is None:
        import torch.nn.parallel.distributed as ddp_module
    DDP = ddp_module.DistributedDataParallel  # noqa: N806 - torch's name

    if _original_init is not None:
        return True
    RUNTIME.settings = RUNTIME.settings or settings
    _original_init = DDP.__init__

    @functools.wraps(_original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _original_init(self, *args, **kwargs)
        try:
            _Tracker(self, _ensure_phases(self)).attach()
        except Exception:  # never break the user's script
            _log.exception("crossover could not hook this DistributedDataParallel; it trains unscheduled")

    setattr(DDP, "__init__", __init__)  # noqa: B010 - the class is torch's
    torch_collectives.install()
    atexit.register(_destroy_process_group)
    return True


def notice_fsdp(fsdp_package: Any) -> None:
    """FSDP's ranks are not tracked (their phases interleave per shard): say so once, when one is built.

    Both of torch's FSDPs: the `FullyShardedDataParallel` module and `fully_shard` (FSDP2),
    as `torch.distributed.fsdp` exports them. The job trains unchanged and unscheduled: no
    session is opened for it, and its collectives pass through `torch_collectives` untouched.
    """
    told: list[bool] = []

    def tell() -> None:
        if not told and RUNTIME.session is None:
            told.append(True)
            _log.warning("FSDP: crossover does not track FSDP's phases; this job trains unscheduled beside the "
                         "device's other jobs")

    fsdp = getattr(fsdp_package, "FullyShardedDataParallel", None)
    if fsdp is not None and not hasattr(fsdp.__init__, "_crossover_noticed"):
        original_init = fsdp.__init__

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            tell()

        __init__._crossover_noticed = True  # type: ignore[attr-defined]
        setattr(fsdp, "__init__", __init__)  # noqa: B010 - the class is torch's
    shard = getattr(fsdp_package, "fully_shard", None)
    if shard is not None and not hasattr(shard, "_crossover_noticed"):
        @functools.wraps(shard)
        def fully_shard(*args: Any, **kwargs: Any) -> Any:
            result = shard(*args, **kwargs)
            tell()
            return result

        fully_shard._crossover_noticed = True  # type: ignore[attr-defined]
        fsdp_package.fully_shard = fully_shard


def uninstall() -> None:
    """Restore DDP and `torch.distributed` and close the session (tests use it)."""
    global _original_init, _step_hook
    if _original_init is not None:
        from torch.nn.parallel.distributed import DistributedDataParallel

        setattr(DistributedDataParallel, "__init__", _original_init)  # noqa: B010
        _original_init = None
    torch_collectives.uninstall()
    if RUNTIME.phases is not None:
        remove_forward_boundaries(RUNTIME.phases)
    if _step_hook is not None:
        _step_hook.remove()
        _step_hook = None
    if RUNTIME.session is not None:
        RUNTIME.session.close()
    RUNTIME.session = RUNTIME.phases = None


def _ensure_phases(ddp: Any) -> PhaseReporter:
    """The rank's one phase state, made with its session by the first DDP module."""
    global _step_hook
    if RUNTIME.phases is not None:
        return RUNTIME.phases
    settings = RUNTIME.settings
    assert settings is not None, "install() reads the settings before any DDP module is built"
    if settings.aggregation.rule:
        _log.warning("CROSSOVER_AGGREGATION=%s is Horovod's; this DDP job averages its gradients as DDP does",
                     settings.aggregation.rule)
    cuda = cuda_index(ddp.module.parameters())
    session = open_session(_identity(ddp, settings, cuda), settings)
    device = RUNTIME.device
    phases = PhaseReporter(session, settle=None if device is None else device.drain)
    if cuda is not None:
        on_gpu(phases, cuda)
    RUNTIME.phases = phases
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _step_hook = register_optimizer_step_pre_hook(lambda _opt, _args, _kwargs: phases.ensure_holding())
    return phases


def _identity(ddp: Any, settings: PluginSettings, cuda: int | None) -> RankIdentity:
    """The rank in the DDP module's own process group. A group smaller than the world (data parallelism
    beside another kind) is a job of its own: its id is the launch's, qualified by the group's first rank."""
    import torch.distributed as dist

    group = getattr(ddp, "process_group", None)
    place = place_from_env(os.environ, rank=dist.get_rank(group), world_size=dist.get_world_size(group))
    job_id = job_id_from_env(os.environ) or _agree_job_id(dist.get_rank())
    local_rank, local_size = place.local_rank, place.local_size
    if place.world_size != dist.get_world_size():
        first = min(dist.get_process_group_ranks(group))
        job_id = uuid.uuid5(uuid.NAMESPACE_URL, f"ddp-group://{job_id}/{first}").hex
        local_size = min(local_size, place.world_size)
        local_rank = local_rank % local_size
    device = cuda if settings.device < 0 and cuda is not None else settings.device
    return RankIdentity(job_id=job_id, job_name=settings.job_name, rank=place.rank, local_rank=local_rank,
                        world_size=place.world_size, local_size=local_size, device=device, framework="ddp")


def _agree_job_id(rank: int) -> str:
    """Outside torchrun: rank 0 draws the id and leaves it in the default group's store for the others.

    DDP's constructor is collective, so every rank gets here at the same point; the store is
    the process group's own rendezvous, so no collective of ours runs on the group.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if rank == 0:
        store.set(_STORE_KEY, uuid.uuid4().hex)
    return bytes(store.get(_STORE_KEY)).decode()


class _Tracker(GradientYields):
    """One DDP module's phase points, reported to the rank's shared `PhaseReporter`."""

    def __init__(self, ddp: Any, phases: PhaseReporter) -> None:
        self.ddp = ddp
        self.phases = phases
        self.grad_hooks: list[Any] = []  # one per parameter, only while outranked
        self.cuda = cuda_index(ddp.module.parameters()) is not None
        self.warned = False  # about an output without tensors to follow

    def attach(self) -> None:
        import torch

        self.ddp.register_forward_pre_hook(torch.compiler.disable(self.before_forward))
        self.ddp.register_forward_hook(torch.compiler.disable(self.after_forward))
        broadcast = self.ddp._distributed_broadcast_coalesced
        self.ddp._distributed_broadcast_coalesced = functools.partial(self._buffers_from_peers, broadcast)

    def _buffers_from_peers(self, broadcast: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        """DDP's broadcast of its buffers (BatchNorm's statistics) in each training forward: a wait for the
        other ranks inside the compute phase, so a holder hands the device back for it where it blocks the host
        (Gloo; NCCL only orders the GPU's streams)."""
        phases = self.phases
        if phases.holding and torch_collectives.blocks_host(tensors, self.ddp.process_group):
            with phases.waiting_for_peers():
                return broadcast(tensors, *args, **kwargs)
        return broadcast(tensors, *args, **kwargs)

    @guarded
    def before_forward(self, _module: Any, _args: Any) -> None:
        self._follow_outranked()
        self.phases.ensure_holding()

    @guarded
    def after_forward(self, _module: Any, _args: Any, output: Any) -> None:
        import torch

        if not (torch.is_grad_enabled() and self.ddp.require_backward_grad_sync):
            return  # no_sync() or no_grad: this forward's backward reduces nothing
        _Open.backward = False  # a new reducing forward: any backward before it is over, even one that raised
        backward = _Backward(self.phases, cuda=self.cuda)
        armed = [t.grad_fn.register_prehook(backward.first_node) for t in _tensors(output)
                 if t.requires_grad and t.grad_fn is not None]
        if not armed and not self.warned:
            self.warned = True
            _log.warning("this DDP module's output holds no tensor crossover can follow (%s): its rank keeps the "
                         "device through the allreduce, and the daemon passes it over when it is overdue",
                         type(output).__name__)

    def _follow_outranked(self) -> None:
        """Between passes: a gradient hook per parameter while a higher class may ask for the device, none else."""
        outranked = self.between_passes()
        if outranked and not self.grad_hooks:
            self.grad_hooks = [p.register_post_accumulate_grad_hook(self._at_gradient)
                               for p in self.ddp.module.parameters() if p.requires_grad]
        elif not outranked and self.grad_hooks:
            for hook in self.grad_hooks:
                hook.remove()
            self.grad_hooks = []

    def _at_gradient(self, _param: Any) -> None:
        self.on_gradient(0, None)


class _Open:
    """Whether a backward's phase points are already reported: one report per backward, however many DDP
    modules or outputs it reaches (its hooks may run on autograd's device threads, several at once)."""

    backward = False
    lock = threading.Lock()


class _Backward:
    """One backward pass of a forward that reduces: its end of compute and its end of communication."""

    def __init__(self, phases: PhaseReporter, cuda: bool) -> None:
        self.phases = phases
        self.cuda = cuda
        self.started = False
        self.comm_start = 0.0

    @guarded
    def first_node(self, _grad_outputs: Any) -> None:
        with _Open.lock:
            if self.started or _Open.backward:
                return
            self.started = _Open.backward = True
        _queue(self.compute_done)

    def compute_done(self) -> None:
        """Every node has run: the last bucket is ready and its allreduce launched; DDP waits for them next."""
        self.phases.comm_begin()
        self.comm_start = time.perf_counter()
        _queue(self.comm_done)

    def comm_done(self) -> None:
        """DDP has waited for every bucket and written the gradients back: the next compute phase asks."""
        _Open.backward = False
        if self.cuda:
            from crossover.plugins.hook.cuda_turns import wait_for_device

            wait_for_device()  # NCCL's kernels end on the GPU, after the host has moved on
        self.phases.comm_end(time.perf_counter() - self.comm_start)


def _queue(callback: Any) -> None:
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(guarded(callback))


def _tensors(output: Any) -> list[Any]:
    """Every tensor in a module's output, as DDP finds them (torch's pytree: tuples, lists, dicts, named
    tuples, dataclasses and registered types), and in the attributes of any other object one level down."""
    import torch
    from torch.utils._pytree import tree_leaves

    found: list[Any] = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif hasattr(leaf, "__dict__"):
            found += [v for v in vars(leaf).values() if isinstance(v, torch.Tensor)]
    return found


def _destroy_process_group() -> None:
    """At exit, shut the default process group down while the interpreter is whole, if the script did not.

    torch's Gloo threads otherwise end during finalisation, where one may abort the process
    after training finished ("terminate called without an active exception"). Bounded:
    a group whose peer died would wait for its timeout.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    worker = threading.Thread(target=dist.destroy_process_group, name="crossover-destroy-pg", daemon=True)
    worker.start()
    worker.join(_DESTROY_S)
    if worker.is_alive():
        _log.warning("the process group did not shut down within %.0f s at exit; leaving it", _DESTROY_S)
