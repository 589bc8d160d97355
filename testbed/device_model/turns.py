"""Hand-overs of the device between ranks, done on the emulated device's streams.

The emulated form of a GPU-side hand-over (cuStreamWaitValue32 /
cuStreamWriteValue32 on host-mapped memory): a rank's device work waits on a
peer's page word, and the device writes the rank's own page word when its work
is done, so the next rank's work starts without a round trip through the host.
`ModelTurns` is the emulated device's `crossover.client.rank.device_turns.DeviceTurns`,
which a rank hands to the plugin (`crossover.auto.use_device`).
"""
from __future__ import annotations

from .client import DeviceClient

__all__ = ["ModelTurns"]


class ModelTurns:
    """`DeviceTurns` on the emulated device: each call is one line of the rank's `DeviceClient`.

    The fds passed in stay the caller's (the server gets duplicates); this closes none of them.
    """

    name = "device model"

    def __init__(self, client: DeviceClient) -> None:
        self.client = client

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
