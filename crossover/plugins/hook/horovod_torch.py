"""Hook `horovod.torch.DistributedOptimizer` so each rank's iteration is scheduled.

Every optimizer the script builds goes through the aggregation rule
(`aggregation`) and then reports its phase points (`phase_tracking`) to the
rank's one `PhaseReporter` (one iteration counter), which the first optimizer
makes together with the rank's session; every other wait for peers frees the
device through `horovod_waits`.
Nothing here changes gradients or parameters: with the `passthrough` policy a
script computes bit-identical results (`CROSSOVER_HOST_STAGING` hands Horovod
host copies of the same tensors, which it reduces as it would its own). Every hook
swallows its own errors (logged) so Crossover can never break training.
"""
from __future__ import annotations

import functools
import logging
import os
import uuid
from dataclasses import replace
from typing import Any

from crossover.client.rank.session import Session
from crossover.plugins.hook import horovod_waits
from crossover.plugins.hook.host_staging import HostStager, horovod_reduces_on_gpu
from crossover.plugins.hook.phase_reporter import PhaseReporter
from crossover.plugins.hook.phase_tracking import remove_forward_boundaries, track_phases
from crossover.plugins.hook.rank_session import cuda_device, open_session
from crossover.plugins.hook.runtime import RUNTIME
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings, script_name

__all__ = ["install", "uninstall"]

_log = logging.getLogger(__name__)


def install(settings: PluginSettings | None = None) -> bool:
    """Wrap `horovod.torch.DistributedOptimizer`; idempotent. False when Horovod is missing or disabled."""
    settings = settings or PluginSettings.from_env(script_name())
    if settings.disabled:
        _log.info("CROSSOVER_DISABLE is set; not hooking Horovod")
        return False
    try:
        import horovod.torch as hvd
        import horovod.torch.optimizer as hvd_opt
    except ImportError as exc:
        _log.warning("horovod.torch is not importable (%s); crossover does nothing", exc)
        return False
    if RUNTIME.original_optimizer is not None:
        return True
    RUNTIME.settings = settings  # first: the aggregation rules follow this read of the environment
    from crossover.plugins.aggregation.selection import prepare_horovod

    prepare_horovod()
    original = hvd.DistributedOptimizer
    RUNTIME.original_optimizer = original

    @functools.wraps(original)
    def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
        # The aggregation rule (CROSSOVER_AGGREGATION) decides how the optimizer is built;
        # without one this is exactly Horovod's own call. A rule that contradicts the
        # script's arguments raises AggregationError here, at start-up, with the reason.
        from crossover.plugins import aggregation

        opt = aggregation.distributed_optimizer(hvd, original, optimizer, args, kwargs)
        try:
            pset = kwargs.get("process_set")
            if pset is not None and not pset.included():
                _log.info("this rank is outside the optimizer's process set; nothing to schedule")
                return opt
            phases = _ensure_phases(hvd, pset)
            track_phases(opt, phases, quiet_wait=settings.quiet_wait)
        except Exception:  # never break the user's script
            _log.exception("crossover could not hook this optimizer; it trains unscheduled")
        return opt

    DistributedOptimizer._crossover_original = original  # type: ignore[attr-defined]
    hvd.DistributedOptimizer = DistributedOptimizer
    hvd_opt.DistributedOptimizer = DistributedOptimizer
    return True


def uninstall() -> None:
    """Restore Horovod's factory and close the session (tests use it)."""
    original = RUNTIME.original_optimizer
    if original is not None:
        import horovod.torch as hvd
        import horovod.torch.optimizer as hvd_opt

        hvd.DistributedOptimizer = original
        hvd_opt.DistributedOptimizer = original
    if RUNTIME.phases is not None:
        remove_forward_boundaries(RUNTIME.phases)
    if RUNTIME.session is not None:
        RUNTIME.session.close()
    horovod_waits.uninstall()
    if RUNTIME.stager is not None:
        RUNTIME.stager.close()
    RUNTIME.stager = None
    RUNTIME.original_optimizer = RUNTIME.session = RUNTIME.phases = RUNTIME.device = None
    RUNTIME.settings = None


def _ensure_phases(hvd: Any, process_set: Any) -> PhaseReporter:
    """The rank's one phase state, made with its session by the first DistributedOptimizer.

    From then on Horovod's waits yield the device (`horovod_waits`), whoever calls them.
    """
    if RUNTIME.phases is None:
        session = _ensure_session(hvd, process_set)
        device = RUNTIME.device
        phases = PhaseReporter(session, settle=None if device is None else device.drain)
        horovod_waits.install(phases, on_init=functools.partial(_follow_reinit, hvd))  # sets RUNTIME.phases
        RUNTIME.stager = _stager()
        return phases
    return RUNTIME.phases


def _stager() -> HostStager | None:
    """The rank's host stager where `CROSSOVER_HOST_STAGING` asks for one and Horovod reduces on the CPU."""
    settings = RUNTIME.settings
    if settings is None or not settings.host_staging:
        return None
    import horovod.torch.mpi_ops as mpi_ops

    if horovod_reduces_on_gpu(mpi_ops):
        _log.info("CROSSOVER_HOST_STAGING: this Horovod reduces CUDA tensors on the GPU; nothing to stage")
        return None
    originals = RUNTIME.original_waits
    return HostStager(originals["allreduce_async_"], originals["grouped_allreduce_async_"])


def _ensure_session(hvd: Any, process_set: Any) -> Session:
    if RUNTIME.session is not None:
        return RUNTIME.session
    settings = RUNTIME.settings
    assert settings is not None, "install() reads the settings before any optimizer is built"
    info = RankIdentity(job_id=_agree_job_id(hvd, process_set), job_name=settings.job_name, rank=hvd.rank(),
                        local_rank=hvd.local_rank(), world_size=hvd.size(), local_size=hvd.local_size(),
                        device=cuda_device(settings.device), framework="horovod")
    return open_session(info, settings)


def _follow_reinit(hvd: Any) -> None:
    """After `hvd.init()` again (an elastic reset): register anew if the rank's place changed.

    Workers were added or removed, so this rank's rank, world size or local rank may
    differ: the daemon's view follows with a new session of the same job. The phase
    state and its iteration counter stay.
    """
    old, phases = RUNTIME.session, RUNTIME.phases
    if old is None or phases is None:
        return
    place = (hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size())
    if place == (old.info.rank, old.info.local_rank, old.info.world_size, old.info.local_size):
        return
    info = replace(old.info, rank=place[0], local_rank=place[1], world_size=place[2], local_size=place[3],
                   pid=0, node="")
    new = Session(info, old.settings)
    new.on_attach = old.on_attach
    old.close()
    RUNTIME.session = phases.session = new.start()
    _log.info("re-registered after a Horovod re-init: rank %d of %d (was %d of %d)", info.rank, info.world_size,
              old.info.rank, old.info.world_size)


def _elastic() -> bool:
    """Launched by `horovodrun` with elastic settings (Gloo only, in Horovod 0.28)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def _agree_job_id(hvd: Any, process_set: Any) -> str:
    """One id for the whole job: rank 0 (of the optimizer's process set) draws it, Horovod broadcasts it.

    Every rank of the set builds the optimizer at the same point of the script,
    so the broadcast is a collective they all reach. Not so in an elastic job: a
    worker added mid-run builds its optimizer while the others synchronise state,
    and a collective only it makes would wait forever (Horovod forbids them there).
    Its workers share the launcher's rendezvous address instead, for the whole run.
    """
    if _elastic():
        env = os.environ
        where = f"{env.get('HOROVOD_GLOO_RENDEZVOUS_ADDR', '')}:{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
        return uuid.uuid5(uuid.NAMESPACE_URL, f"horovod-elastic://{where}").hex
    mine = uuid.uuid4().hex
    if hvd.size() == 1:
        return mine
    kwargs: dict[str, Any] = {"name": "crossover.job_id"}
    root = 0
    ranks = getattr(process_set, "ranks", None) if process_set is not None else None
    if ranks:
        kwargs["process_set"] = process_set
        root = ranks[0]
    return str(hvd.broadcast_object(mine, root_rank=root, **kwargs))
