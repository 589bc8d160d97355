"""Hand-overs of the device between ranks, done on the emulated device's streams.

The emulated form of a GPU-side hand-over (cuStreamWaitValue32 /
cuStreamWriteValue32 on host-mapped memory): a rank's device work waits on a
peer's page word, and the device writes the rank's own page word when its work
is done, so the next rank's work starts without a round trip through the host.
`ModelTurns` is the emulated device's `crossover.client.rank.device_turns.DeviceTurns`,
which a rank hands to the plugin (`crossover.plugins.hook.rank_session.use_device`). It is the device's
`crossover.client.rank.device_memory.DeviceMemory` too: its allocator pool (`memory`)
is what the daemon's memory caps apply to, and `need` is a workload's allocation.
"""
from __future__ import annotations

from collections.abc import Callable

from crossover.client.rank.device_memory import Footprint, OverMemoryCap
from crossover.plugins.hook.cuda_memory import cap_exceeded

from .client import DeviceClient

__all__ = ["ModelTurns"]


class ModelTurns:
    """`DeviceTurns` on the emulated device: each call is one line of the rank's `DeviceClient`.

    The fds passed in stay the caller's (the server gets duplicates); this closes none of them.
    """

    name = "device model"

    def __init__(self, client: DeviceClient) -> None:
        self.client = client
        self._refused: Callable[[int], str] | None = None

    def need(self, pool_bytes: int) -> None:
        """The workload's allocations reach `pool_bytes`: grow the pool, or raise torch's `OutOfMemoryError`
        as its allocator does, with the plugin's line when a cap refused it."""
        refusal = self.client.alloc(pool_bytes)
        if not refusal:
            return
        import torch

        reason, pool, limit, free = refusal[0], *map(int, refusal[1:])
        line = self._refused(max(0, pool_bytes - pool)) if self._refused is not None and reason == "cap" else ""
        what = (f"its pool may not pass {limit / 2**20:.0f} MiB" if reason == "cap"
                else f"the device has {free / 2**20:.0f} MiB free")
        raise torch.OutOfMemoryError(f"emulated device out of memory: tried to grow the pool from "
                                     f"{pool / 2**20:.0f} MiB to {pool_bytes / 2**20:.0f} MiB and {what}"
                                     + (f"\n{line}" if line else ""))

    def footprint(self) -> Footprint | None:
        held = self.client.footprint()
        return None if held is None else Footprint(*held)

    def set_limit(self, pool_bytes: int | None) -> None:
        self.client.limit(pool_bytes)

    def on_refusal(self, callback: Callable[[int], str]) -> None:
        self._refused = callback

    def refusal(self, line: str) -> OverMemoryCap:
        return cap_exceeded(f"emulated device out of memory: this process holds more than its cap\n{line}")

    def attach_own(self, fd: int) -> None:
        """Map the own page on the server before returning (a sync follows the line): the daemon seals the
        page against new writable mappings once the rank says it is mapped."""
        self.client.attach_page(fd, None)
        self.client.sync()

    def attach_peer(self, page: int, fd: int) -> None:
        self.client.attach_page(fd, page)

    def wait(self, page: int, ticket: int) -> None:
        self.client.wait(page, ticket)

    def signal(self, ticket: int) -> None:
        self.client.signal(ticket)

    def drain(self) -> None:
        self.client.sync()
