"""Checks read from a daemon's event log: who held each device when, whether compute phases
overlapped on a device, and whether every grant went to the rank whose turn it was."""
from __future__ import annotations

from typing import Any

__all__ = ["compute_intervals", "grants_out_of_turn", "overlaps"]


def compute_intervals(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per device, the [grant, release) intervals from the event log.

    An `overdue` holder's interval ends where the daemon gave its device to the next rank.
    """
    open_: dict[tuple[Any, Any], tuple[float, int]] = {}
    out: dict[int, list[tuple[float, float, str, int]]] = {}
    for e in events:
        key = (e.get("job"), e.get("rank"))
        if e["event"] == "grant":
            open_[key] = (e["t"], e["device"])
        elif e["event"] in ("release", "leave", "overdue") and key in open_:
            t0, dev = open_.pop(key)
            out.setdefault(dev, []).append((t0, e["t"], key[0], key[1]))
    return out


def overlaps(intervals: list[tuple[float, float, str, int]]) -> list[tuple]:
    """Pairs of intervals (sorted by start) where the later one starts before the earlier one ends."""
    s = sorted(intervals)
    return [(a, b) for a, b in zip(s, s[1:]) if b[0] < a[1]]


def grants_out_of_turn(events: list[dict[str, Any]]) -> list[str]:
    """Grants in the daemon's log that did not go to the smallest (turn, job id) waiting on the device.

    Only requests the policy has seen compete. While a lease is being revoked on a
    device, other ranks' requests are held back until every holder has said what it
    computes (LEASE_RELEASED, an expired lease, or the holder leaving), and the holder's
    own request, made while it computed under the lease, is granted at once: it records
    work already running, not a choice between waiting ranks.
    """
    pending: dict[tuple, tuple[int, str]] = {}
    held: dict[Any, dict[tuple, tuple[int, str]]] = {}
    revoking: dict[Any, set[tuple]] = {}
    wrong: list[str] = []
    for e in events:
        dev = e.get("device")
        who = (dev, e.get("job"), e.get("rank"))
        kind = e["event"]
        if kind == "lease_revoke":
            revoking.setdefault(dev, set()).add(who)
        elif kind in ("lease_released", "lease_expired") or (kind in ("leave", "suspend")
                                                            and who in revoking.get(dev, ())):
            holders = revoking.get(dev, set())
            holders.discard(who)
            if not holders:
                revoking.pop(dev, None)
                pending.update(held.pop(dev, {}))
        if kind == "request":
            if revoking.get(dev) and who not in revoking[dev]:
                held.setdefault(dev, {})[who] = (e["turn"], e["job"])
            else:
                pending[who] = (e["turn"], e["job"])
        elif kind == "grant":
            mine = pending.pop(who, None)
            rivals = [k for w, k in pending.items() if w[0] == dev]
            if mine is None:
                wrong.append(f"grant to {who} with no request the policy had seen")
            elif rivals and min(rivals) < mine:
                wrong.append(f"grant to {who} at {mine} while {sorted(rivals)} waited")
        elif kind in ("cancel", "leave", "suspend"):  # a resumed rank's request is logged again
            pending.pop(who, None)
            held.get(dev, {}).pop(who, None)
    return wrong
