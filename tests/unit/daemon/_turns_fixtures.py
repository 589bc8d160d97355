"""Helpers shared by the `turns` policy tests: default settings, rank references, a policy with ranks joined."""
from __future__ import annotations

from crossover.daemon.api import RankKey, RankRef
from testbed.simulator.turns import TurnsPolicy, TurnsSettings

S = TurnsSettings()


def ref(job: str, rank: int = 0, device: int = 0, world: int = 2) -> RankRef:
    return RankRef(RankKey(job, rank), job_name=f"name-{job}", device=device, world_size=world, joined_at=0.0)


A, B, C = ref("a"), ref("b"), ref("c")


def joined(*ranks: RankRef, policy: TurnsPolicy | None = None) -> TurnsPolicy:
    p = policy or TurnsPolicy()
    for r in ranks:
        p.join(r, now=0.0)
    return p
