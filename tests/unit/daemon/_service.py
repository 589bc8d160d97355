"""The bounded-service check shared by the crossover policy and its simulator variant."""
from __future__ import annotations

from crossover.daemon.api import RankKey
from crossover.daemon.policies import CrossoverPolicy


def assert_first_in_line_served_within(p: CrossoverPolicy, jobs: list[str], overtakes: int, grants: int = 300) -> None:
    """Each job's rank 0 asks in turn, 5 ms apart; then, grant after grant, the holder releases and comes
    straight back (the hardest case for a long job). The rank first in line must be served within
    `overtakes` + 1 grants."""
    now = 0.0
    for j in jobs:
        now += 0.005
        p.request(RankKey(j, 0), 0, now)
    head_since: dict[RankKey, int] = {}
    for grant in range(grants):
        (holder,) = p.view(0).holders
        now += 0.005
        p.release(holder, now)
        now += 0.005
        p.request(holder, grant + 1, now)
        waiting = sorted(p.view(0).waiting, key=lambda k: p._q.requested_at[k])
        if waiting:
            head = waiting[0]
            head_since.setdefault(head, grant)
            assert grant - head_since[head] <= overtakes + 1, f"{head} first in line for too long"
        for k in list(head_since):
            if k not in waiting:
                del head_since[k]
