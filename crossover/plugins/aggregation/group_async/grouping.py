"""Which ranks train together: static groups, or groups of similar pace from measured step times.

Pure logic, used by the sampler at epoch boundaries (points every rank
reaches) and unit-tested directly. Speeds come from the same per-rank
measurements the LB-BSP controller uses: the seconds one rank's compute
phase took per sample.
"""
from __future__ import annotations

from collections.abc import Sequence

from crossover.errors import CrossoverError

__all__ = ["GroupingError", "parse_groups", "speed_groups", "static_groups", "steps_per_group"]

Groups = tuple[tuple[int, ...], ...]


class GroupingError(CrossoverError, ValueError):
    """A group spec that does not partition the ranks."""


def parse_groups(spec: str, world: int) -> Groups:
    """``"2"`` (two groups of consecutive ranks) or ``"0,1;2,3"`` (one rank list per group)."""
    text = spec.strip()
    if not text:
        raise GroupingError("empty group spec: give a count (2) or rank lists (0,1;2,3)")
    if ";" not in text and "," not in text:
        try:
            count = int(text)
        except ValueError:
            raise GroupingError(f"group spec {spec!r} is neither a count nor rank lists") from None
        return static_groups(world, count)
    try:
        groups = tuple(tuple(int(r) for r in part.split(",") if r.strip()) for part in text.split(";"))
    except ValueError:
        raise GroupingError(f"group spec {spec!r}: ranks must be integers") from None
    return _checked(groups, world, spec)


def _checked(groups: Groups, world: int, spec: object) -> Groups:
    flat = [r for g in groups for r in g]
    if any(not g for g in groups):
        raise GroupingError(f"group spec {spec!r} has an empty group")
    if sorted(flat) != list(range(world)):
        raise GroupingError(f"group spec {spec!r} must name every rank 0..{world - 1} exactly once")
    return tuple(tuple(sorted(g)) for g in sorted(groups, key=min))


def static_groups(world: int, count: int) -> Groups:
    """``count`` groups of consecutive ranks, sizes differing by at most one."""
    if not 1 <= count <= world:
        raise GroupingError(f"{count} groups for {world} ranks: use 1..{world}")
    base, extra = divmod(world, count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(tuple(range(start, start + size)))
        start += size
    return tuple(groups)


def _waiting(members: Sequence[int], per_sample_s: Sequence[float], stalls: Sequence[float] | None) -> float:
    """Seconds per sample the ranks of one group wait for each other. With equal shares each waits for the
    slowest; with shares cut by pace (``stalls`` given) the steady paces are balanced away and what is left is
    the stalls: each member's stall holds every other member."""
    if stalls is None:
        slowest = max(per_sample_s[r] for r in members)
        return sum(slowest - per_sample_s[r] for r in members)
    return (len(members) - 1) * sum(max(0.0, stalls[r]) for r in members)


def _cost(groups: Groups, per_sample_s: Sequence[float], stalls: Sequence[float] | None = None) -> float:
    return sum(_waiting(g, per_sample_s, stalls) for g in groups)


def speed_groups(per_sample_s: Sequence[float], count: int, current: Groups | None = None,
                 hysteresis: float = 0.1, stalls: Sequence[float] | None = None) -> Groups:
    """``count`` groups of ranks that wait least for each other, keeping ``current`` unless the new grouping
    cuts that waiting by more than ``hysteresis`` times the ranks' summed pace (a share of the job's work,
    so tiny differences never regroup).

    Without ``stalls`` (equal shares inside a group), ranks of similar pace go together: the contiguous
    split of the ranks sorted by seconds per sample with the least waiting for each group's slowest member.
    With ``stalls`` (each rank's seconds per sample lost to stalls, `stalls.StallMeter`: groups that cut
    their batch by pace balance the rest away), ranks that stall go together, away from those that do
    not: the contiguous split of the ranks sorted by stall, in groups of static sizes (differing by at
    most one). Left free, the least stall cost is one staller alone and everybody else in one group,
    whose every step then pays an allreduce among nearly all ranks (measured at 8 ranks: groups of 7
    and 1 took 147 ms an allreduce at the median where groups of 4 and 4 took 87 ms).
    Exact, by dynamic programming over split points; ties go to more even sizes.
    """
    world = len(per_sample_s)
    if not 1 <= count <= world:
        raise GroupingError(f"{count} groups for {world} ranks: use 1..{world}")
    key = per_sample_s if stalls is None else stalls
    order = sorted(range(world), key=lambda r: (key[r], r))
    inf = float("inf")
    # best[k][i]: least waiting for the first i sorted ranks in k groups; cut[k][i]: where the last group starts
    best = [[inf] * (world + 1) for _ in range(count + 1)]
    cut = [[0] * (world + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    base = world // count
    for k in range(1, count + 1):
        for i in range(k, world + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or (stalls is not None and not base <= i - j <= base + 1):
                    continue
                wait = _waiting(order[j:i], per_sample_s, stalls)
                spread = abs((i - j) - world / count) * 1e-12  # ties: more even sizes
                value = best[k - 1][j] + wait + spread
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    groups: list[tuple[int, ...]] = []
    i = world
    for k in range(count, 0, -1):
        j = cut[k][i]
        groups.append(tuple(order[j:i]))
        i = j
    proposed = _checked(tuple(groups), world, "speed grouping")
    if current is None or proposed == current:
        return proposed
    old, new = _cost(current, per_sample_s, stalls), _cost(proposed, per_sample_s, stalls)
    return proposed if old - new > hysteresis * sum(per_sample_s) else current


def steps_per_group(groups: Groups, per_sample_s: Sequence[float], samples: int, batch: int,
                    balanced: bool = False) -> list[int]:
    """Steps each group takes in an epoch of ``samples``, in proportion to its pace, so groups finish together.

    A group of ``n`` ranks, each taking ``batch`` samples a step, moves at its
    slowest member's pace: ``n`` samples per ``max(per_sample_s)`` seconds;
    ``balanced`` (members' shares cut by pace, ``balance.py``) at the sum of
    its members' speeds. Every group takes at least one step; whole steps only
    (the rest of the epoch is dropped, as ``drop_last`` does).
    """
    def rate(g: tuple[int, ...]) -> float:
        if balanced:
            return sum(1.0 / max(per_sample_s[r], 1e-12) for r in g)
        return len(g) / max(max(per_sample_s[r] for r in g), 1e-12)

    rates = [rate(g) for g in groups]
    total = sum(rates)
    if samples < sum(len(g) for g in groups) * batch:
        raise GroupingError(f"{samples} samples cannot give each of {len(groups)} groups one step of {batch}")
    steps = [max(1, int(samples * rate / total) // (len(g) * batch)) for g, rate in zip(groups, rates)]
    while sum(s * len(g) * batch for s, g in zip(steps, groups)) > samples:  # a floor of 1 overdrew
        largest = max(range(len(groups)), key=lambda k: steps[k] * len(groups[k]))
        steps[largest] -= 1
    return steps
