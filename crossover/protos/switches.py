"""The operator's on/off switches on the wire (`PolicyRequest.adapt`, `PolicyRequest.handover`): unchanged, on, off."""
from __future__ import annotations

from crossover.protos import crossover_v1_pb2 as pb

__all__ = ["to_wire"]


def to_wire(on: bool | None) -> pb.Adapt:
    """None: leave the switch as it is."""
    return pb.ADAPT_UNCHANGED if on is None else pb.ADAPT_ON if on else pb.ADAPT_OFF
