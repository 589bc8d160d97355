"""A group_async checkpoint record: where training stood (the global model's version, the schedule's
stage, the groups and the paces their steps were planned from), read back with every field checked.
Pure: the runtime writes the record and applies what `read_record` returns."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from crossover.plugins.aggregation.group_async.grouping import Groups
from crossover.plugins.aggregation.selection import AggregationError

__all__ = ["Saved", "read_record"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Saved:
    """What a record restores: `groups` and `paces` are None when it was saved at another world size."""

    schedule: Any
    groups: Groups | None
    paces: list[float] | None
    version: int
    boundaries: int
    exchanges: int


def read_record(state: dict[str, Any], world: int) -> Saved:
    """The record a runtime's `state_dict` wrote, for a job of `world` ranks; AggregationError when it is
    not one, or when its groups or paces do not fit the world it was saved at. Groups and paces saved at
    another world size are dropped (the first boundary measures anew)."""
    try:
        saved_world = int(state["world"])
        groups: Groups = tuple(tuple(int(r) for r in g) for g in state["groups"])
        paces = [float(p) for p in state["paces"]]
        version = int(state["version"])
        schedule = state["schedule"]
    except (KeyError, TypeError, ValueError) as exc:
        raise AggregationError(f"group_async: not a state this optimizer saved ({exc})") from exc
    boundaries, exchanges = int(state.get("boundaries", 0)), int(state.get("exchanges", 0))
    if saved_world != world:
        _log.warning("group_async: the checkpoint's %d ranks are %d now; its groups and paces are dropped",
                     saved_world, world)
        return Saved(schedule, None, None, max(0, version), boundaries, exchanges)
    if sorted(r for g in groups for r in g) != list(range(world)) or len(paces) not in (0, world):
        raise AggregationError(f"group_async: the saved groups {groups} or paces do not fit {world} ranks")
    return Saved(schedule, groups, paces, max(0, version), boundaries, exchanges)
