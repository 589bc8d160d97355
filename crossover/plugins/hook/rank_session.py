"""What every front end does with a rank's session: open it, close it at exit, pin it, and the public helpers.

Horovod's (`horovod_torch`) and DDP's (`ddp_torch`) front ends differ in how they
learn who the rank is and where its phases begin and end; from the identity on,
a rank is a rank: one `Session` with the daemon, one `PhaseReporter`, in `RUNTIME`.
`waiting` is what `crossover.auto` offers a script, whichever framework it uses;
`use_device` is how a device the plugin does not find itself joins (CUDA GPUs it finds):
the test bed's emulated device is the one such device, so it is no script's API.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from crossover.client.rank.device_memory import DeviceMemory
from crossover.client.rank.device_turns import DeviceTurns
from crossover.client.rank.session import Session
from crossover.plugins.hook.runtime import RUNTIME
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings

__all__ = ["cuda_device", "open_session", "use_device", "waiting"]

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def waiting(resume: bool = True) -> Iterator[None]:
    """Around a wait outside the framework (a file, a queue, a remote service): the device is free during it.

    The framework's own waits free it already; a rank that holds its device while it waits
    for something else keeps every co-located job from computing, and past the
    daemon's overdue floor it is passed over. A holder asks for the device again as
    the block ends, with the same iteration; with ``resume=False`` only at its next
    phase point (Horovod: ``zero_grad`` or an allreduce's end; DDP: a forward or an optimizer step), for a
    wait after which the script
    does other work first (building a model, writing a checkpoint). Without a session
    this does nothing.
    """
    phases = RUNTIME.phases
    if phases is None:
        yield
    elif resume:
        with phases.waiting_for_peers():
            yield
    else:
        phases.pause()
        yield


def use_device(turns: DeviceTurns) -> None:
    """This rank's device is not CUDA but can order its work: hand turns over on it (see `device_turns`).

    For a device the plugin does not know (CUDA GPUs it finds itself): `turns` waits on
    the daemon's turn pages and stores into them in the order of the device's work, and
    drains it (each release waits for that where the turn does not end on the device).
    Call it once, before or after the rank registers. A device that is a `DeviceMemory` too has its
    allocator capped as the daemon says (`crossoverd --reserve`).
    """
    RUNTIME.device = turns
    phases = RUNTIME.phases
    if phases is not None:
        phases.settle = turns.drain
    session = RUNTIME.session
    if session is not None:
        _use(session, turns)


def _use(session: Session, device: DeviceTurns) -> None:
    """Hand turns over on the device; where it has an allocator the memory caps apply to, cap it too."""
    session.use_device(device)
    if isinstance(device, DeviceMemory):
        session.memory.use(device)


def cuda_device(default: int) -> int:
    """The rank's CUDA device where torch has one, else ``default`` (-1: the daemon chooses)."""
    if default >= 0:
        return default
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:  # torch without a CUDA runtime: let the daemon choose
        pass
    return default


def open_session(info: RankIdentity, settings: PluginSettings) -> Session:
    """Register the rank with its daemon (`RUNTIME.session`), and close the session when the process ends."""
    session = Session(info, settings)
    if settings.pin:
        session.on_attach = pin
    RUNTIME.session = session.start()
    if RUNTIME.device is not None:
        _use(session, RUNTIME.device)
    # Close the stream on exit: the daemon then sees a clean end at once instead of
    # waiting for heartbeats that stop while the interpreter shuts down.
    atexit.register(_close_session)
    if settings.stats_file:
        atexit.register(_write_stats, settings.stats_file.replace("{rank}", str(info.rank)))
    return session


def _close_session() -> None:
    if RUNTIME.session is not None:
        RUNTIME.session.close()


def _write_stats(path: str) -> None:
    session = RUNTIME.session
    if session is None:
        return
    waits = session.grant_waits
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"rank": session.info.rank, "job_id": session.info.job_id, "attached": session.attached,
                       "grant_waits_s": waits.first, "acquires": waits.count,
                       "grant_wait_histogram": waits.histogram(),
                       "leased_acquires": session.leased_acquires,
                       "transport": session.transport, "framework": session.info.framework,
                       "yields": RUNTIME.phases.yields if RUNTIME.phases is not None else 0}, f)
    except OSError as exc:
        _log.warning("could not write CROSSOVER_STATS_FILE %s: %s", path, exc)


def affinity_plan(tids: list[int], compute_tid: int, device_cores: set[int], host_cores: set[int],
                  usable: set[int]) -> dict[int, set[int]]:
    """Which cores each thread of a rank may run on.

    Without host cores (or none of them usable, or all of them device cores) every
    thread goes to the device's cores: the emulated device is then the whole rank.
    With them, only the compute thread stays on the device's cores and every other
    thread (Horovod's background loop or Gloo's workers; gRPC's pollers) moves to the
    host cores, as a GPU's host threads run beside it rather than on it. Threads
    created later inherit their creator's cores, so intra-op threads the compute
    thread starts stay on the device.
    """
    host = (host_cores & usable) - device_cores
    if not host:
        return {tid: set(device_cores) for tid in tids}
    return {tid: set(device_cores) if tid == compute_tid else set(host) for tid in tids}


def pin(reg: Any) -> None:
    """CPU devices: pin the rank's threads to the device's cores (and host cores, `CROSSOVER_HOST_CORES`)."""
    cores = set(reg.cpu_affinity)
    if not cores:
        return
    settings = RUNTIME.settings
    wanted = set(settings.host_cores) if settings is not None else set()
    usable = os.sched_getaffinity(0) | cores
    if wanted and not (wanted & usable) - cores:
        _log.warning("CROSSOVER_HOST_CORES %s names no usable core outside the device's %s; every thread stays "
                     "on the device's cores", sorted(wanted), sorted(cores))
    tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    plan = affinity_plan(tids, threading.main_thread().native_id or os.getpid(), cores, wanted, usable)
    for tid, allowed in plan.items():
        try:
            os.sched_setaffinity(tid, allowed)
        except OSError:  # the thread ended meanwhile
            pass
    try:
        import torch

        torch.set_num_threads(len(cores))
    except Exception:
        pass
    host = sorted(set().union(*plan.values()) - cores)
    if host:
        _log.info("compute thread pinned to cores %s (device %d), %d other threads to host cores %s",
                  sorted(cores), reg.device, len(plan) - 1, host)
    else:
        _log.info("pinned to cores %s (device %d)", sorted(cores), reg.device)
