"""A turn page as both ends read it (docs/handover.md): 4096 bytes whose first 32-bit little-endian word is the
last ticket its rank's device stored. Tickets count up and wrap: a word has reached a ticket when it is at most
2^31 - 1 ahead of it, the comparison CUDA's `cuStreamWaitValue32(..., CU_STREAM_WAIT_VALUE_GEQ)` makes, so the
daemon, the plugin and the emulated device all agree on when a waiter may go on."""
from __future__ import annotations

import struct

__all__ = ["PAGE_BYTES", "WORD", "reached"]

PAGE_BYTES = 4096
WORD = struct.Struct("<I")


def reached(word: int, ticket: int) -> bool:
    """Whether a page whose word is `word` lets a waiter for `ticket` go on (cyclic, as the GPU compares)."""
    return (word - ticket) & 0xFFFFFFFF < 1 << 31
