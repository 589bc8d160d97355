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


@dataclass
class DeviceStats:
    utilization: float = -1.0
    memory_used: int = 0
    memory_total: int = 0
    process_memory: dict[int, int] = field(default_factory=dict)  # pid -> bytes


def parse_cpu_devices(spec: str, cpu_count: int) -> list[int]:
    """`"2"` → cores [0, 1]; `"3,5"` or `"3-5"` → those core ids. Validated against the machine."""
    spec = spec.strip()
    if not spec:
        raise InvalidRequest("--cpu-devices is empty; give a count (e.g. 2) or core ids (e.g. 0,1 or 2-3)")
    try:
        if spec.isdigit():
            n = int(spec)
            if n < 1:
                raise InvalidRequest(f"--cpu-devices {spec}: need at least one device")
            cores = list(range(n))
        else:
            cores = []
            for part in spec.split(","):
                if "-" in part:
                    lo, hi = (int(x) for x in part.split("-", 1))
                    cores.extend(range(lo, hi + 1))
                else:
                    cores.append(int(part))
    except ValueError:
        raise InvalidRequest(f"--cpu-devices {spec!r} is neither a count nor a list of core ids") from None
    bad = [c for c in cores if c < 0 or c >= cpu_count]
    if bad:
        raise InvalidRequest(f"--cpu-devices {spec!r}: cores {bad} do not exist (this machine has {cpu_count})")
    if len(set(cores)) != len(cores):
        raise InvalidRequest(f"--cpu-devices {spec!r} names a core twice")
    return cores


class Inventory:
    """Lists devices and samples their utilization; NVML when a driver is present."""

    def __init__(self, devices: Sequence[Device], nvml: Any = None) -> None:
        if not devices:
            raise InvalidRequest("no devices: no GPU driver found and --cpu-devices not given")
        self.devices = list(devices)
        self._nvml = nvml

    @classmethod
    def detect(cls, cpu_cores: Sequence[int] | None) -> Inventory:
        """CPU devices when cores are given, else the GPUs NVML reports."""
        if cpu_cores:
            return cls([Device(i, "cpu", f"cpu{c}", (c,)) for i, c in enumerate(cpu_cores)])
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
            devices.append(Device(i, "gpu", name.decode() if isinstance(name, bytes) else str(name)))
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
            return DeviceStats(float(util.gpu), int(mem.used), int(mem.total), procs)
        except Exception as exc:  # NVMLError: keep serving without GPU figures
            _log.warning("NVML query for device %d failed: %s", index, exc)
            return DeviceStats()
