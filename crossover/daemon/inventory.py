"""The node's devices: GPUs through NVML, or CPU cores standing in for them.

With `--cpu-devices`, each listed core is one device and ranks placed on it
are told to pin themselves there, so co-located ranks contend for one core
the way processes contend for one GPU.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from crossover.daemon.api import InvalidRequest

__all__ = ["Device", "Inventory", "DeviceStats", "parse_cpu_devices"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    index: int
    kind: str  # "gpu" | "cpu"
    name: str
    cpu_affinity: tuple[int, ...] = ()
    memory_total: int = 0  # bytes its jobs may use, the driver's own reserve left out (0: not known)


@dataclass
class DeviceStats:
    utilization: float = -1.0
    memory_used: int = 0
    memory_total: int = 0
    memory_free: int = 0
    process_memory: dict[int, int] = field(default_factory=dict)  # pid -> bytes


def parse_cpu_devices(spec: str, cpu_count: int) -> list[int]:
    """`"2"` → cores [0, 1]; `"3,5"` or `"3-5"` → those core ids; `"3,"` → core 3 alone; `"0"`, which cannot
    be a count, → core 0. Validated against the machine; each refusal is one short line."""
    spec = spec.strip()
    if not spec:
        raise InvalidRequest("--cpu-devices is empty; give a count (e.g. 2) or core ids (e.g. 0,1 or 2-3)")
    if spec.isdigit() and int(spec) > 0:
        n = int(spec)
        if n > cpu_count:
            raise InvalidRequest(f"--cpu-devices {spec}: this machine has {cpu_count} cores (0-{cpu_count - 1})")
        return list(range(n))
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise InvalidRequest(f"--cpu-devices {spec!r} is neither a count nor a list of core ids (0,1 or 2-3)")
        if dash and int(hi) < int(lo):
            raise InvalidRequest(f"--cpu-devices {spec!r}: the range {part} runs backwards (write {hi}-{lo})")
        cores.extend(range(int(lo), int(hi if dash else lo) + 1))
    if not cores:
        raise InvalidRequest(f"--cpu-devices {spec!r} names no core; give a count (2) or core ids (0,1 or 2-3)")
    bad = sorted({c for c in cores if c >= cpu_count})
    if bad:
        named = ", ".join(map(str, bad[:3])) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise InvalidRequest(f"--cpu-devices {spec!r}: no core {named}: this machine has {cpu_count} cores "
                             f"(0-{cpu_count - 1})")
    if len(set(cores)) != len(cores):
        raise InvalidRequest(f"--cpu-devices {spec!r} names a core twice")
    return cores


def _usable_memory(nv: Any, handle: Any) -> int:
    """The device's memory less what its driver reserves for itself (NVML's version 2 query says how
    much; an older driver's total is used as it is)."""
    try:
        info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
        return int(info.total) - int(info.reserved)
    except Exception:  # NVMLError_FunctionNotFound / TypeError from an older driver or binding
        try:
            return int(nv.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception:  # NVMLError: the device still schedules; reservations there cap nothing
            _log.warning("NVML cannot say how much memory this GPU has; --reserve caps nothing on it")
            return 0


class Inventory:
    """Lists devices and samples their utilization; NVML when a driver is present."""

    def __init__(self, devices: Sequence[Device], nvml: Any = None) -> None:
        if not devices:
            raise InvalidRequest("no devices: no GPU driver found and --cpu-devices not given")
        self.devices = list(devices)
        self._nvml = nvml

    @classmethod
    def detect(cls, cpu_cores: Sequence[int] | None, cpu_memory: int = 0) -> Inventory:
        """CPU devices when cores are given (each standing in for a GPU of `cpu_memory` bytes, for memory
        reservations on a test bed), else the GPUs NVML reports."""
        if cpu_cores:
            return cls([Device(i, "cpu", f"cpu{c}", (c,), cpu_memory) for i, c in enumerate(cpu_cores)])
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # pynvml raises its own NVMLError family, or ImportError
            raise InvalidRequest(
                f"no GPU found through NVML ({exc}); pass --cpu-devices N to schedule CPU cores instead"
            ) from None
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            devices.append(Device(i, "gpu", name.decode() if isinstance(name, bytes) else str(name),
                                  memory_total=_usable_memory(pynvml, h)))
        _log.info("NVML reports %d GPU(s)", len(devices))
        return cls(devices, nvml=pynvml)

    def by_index(self, index: int) -> Device:
        if not 0 <= index < len(self.devices):
            raise InvalidRequest(f"device {index} does not exist (this node has {len(self.devices)})")
        return self.devices[index]

    def stats(self, index: int) -> DeviceStats:
        if self._nvml is None:
            return DeviceStats()
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            procs = {p.pid: int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
            return DeviceStats(float(util.gpu), int(mem.used), int(mem.total), int(mem.free), procs)
        except Exception as exc:  # NVMLError: keep serving without GPU figures
            _log.warning("NVML query for device %d failed: %s", index, exc)
            return DeviceStats()
