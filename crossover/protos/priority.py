"""Priority classes on the wire: the names operators and `CROSSOVER_PRIORITY` use, and `crossover.v1.Priority`."""
from __future__ import annotations

from crossover.protos import crossover_v1_pb2 as pb

__all__ = ["NAMES", "name_of", "to_wire"]

NAMES = ("low", "normal", "high")


def to_wire(name: str) -> str:
    """The enum name every message's priority field takes for `low`, `normal` or `high`; "" is
    PRIORITY_UNSPECIFIED (ask for nothing). ValueError for another name."""
    wire = f"PRIORITY_{name.upper()}" if name else "PRIORITY_UNSPECIFIED"
    pb.Priority.Value(wire)
    return wire


def name_of(value: int | str) -> str | None:
    """`low`, `normal` or `high` for an enum value or its JSON name (`PRIORITY_LOW`); None for
    PRIORITY_UNSPECIFIED or a value this version does not know."""
    if isinstance(value, int):
        try:
            value = str(pb.Priority.Name(value))
        except ValueError:
            return None
    name = value.removeprefix("PRIORITY_").lower()
    return name if name in NAMES else None
