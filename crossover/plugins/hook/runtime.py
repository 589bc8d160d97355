"""The Horovod hook's one state for the life of a training process (`RUNTIME`).

What the hook replaced in Horovod (to put it back), and the rank's settings, session, phase reporter
and device, which every part of the hook reads: `horovod_torch` (the optimizer factory and the
session), `horovod_waits` (Horovod's waits) and `optimizer_state` (the optimizer-state broadcast).
One process trains one rank, so there is one; `horovod_torch.uninstall` puts it back as it was.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from crossover.client.rank.device_turns import DeviceTurns
from crossover.client.rank.session import Session
from crossover.plugins.hook.host_staging import HostStager
from crossover.plugins.hook.phase_reporter import PhaseReporter
from crossover.settings import PluginSettings

__all__ = ["RUNTIME", "HookRuntime"]


@dataclass
class HookRuntime:
    """The hook's state; each field None (or empty) until the step that sets it."""

    settings: PluginSettings | None = None  # read once, when the hook is installed
    original_optimizer: Callable[..., Any] | None = None  # Horovod's DistributedOptimizer, while it is hooked
    session: Session | None = None  # made by the first DistributedOptimizer
    phases: PhaseReporter | None = None  # the rank's one reporter: its iteration counter, its waits
    device: DeviceTurns | None = None  # a device the script handed over turns on (`use_device`)
    original_waits: dict[str, Callable[..., Any]] = field(default_factory=dict)  # Horovod's wait functions
    waits_hooked: bool = False  # whether Horovod's modules call `horovod_waits`' wrappers now
    on_init: Callable[[], None] | None = None  # after every later `hvd.init()` (an elastic reset)
    original_broadcast: Callable[..., Any] | None = None  # Horovod's broadcast_optimizer_state, once replaced
    stager: HostStager | None = None  # CROSSOVER_HOST_STAGING on a Horovod that reduces CUDA tensors on the CPU


RUNTIME = HookRuntime()
