"""One rank's identity, the same record on both ends: the client sends it, the daemon registers it.

`RankIdentity` is the typed form of the wire message `crossover.v1.RankIdentity`;
`to_pb`/`from_pb` are the only places the two meet.
"""
from __future__ import annotations

from dataclasses import dataclass

from crossover.protos import crossover_v1_pb2 as pb

__all__ = ["RankIdentity"]


@dataclass(frozen=True)
class RankIdentity:
    """Who a rank is: its job, its place in the job, where it runs and its process.

    `device` -1 lets the daemon choose (by `local_rank`); `pid` 0 and `node` ""
    are filled in by the client's session before it registers.
    """

    job_id: str
    job_name: str
    rank: int
    local_rank: int
    world_size: int
    local_size: int
    device: int = -1
    pid: int = 0
    node: str = ""
    framework: str = ""  # the front end that registered the rank: "horovod" or "ddp"

    def to_pb(self) -> pb.RankIdentity:
        return pb.RankIdentity(job_id=self.job_id, job_name=self.job_name, rank=self.rank,
                               local_rank=self.local_rank, world_size=self.world_size,
                               local_size=self.local_size, node=self.node, device=self.device, pid=self.pid,
                               framework=self.framework)

    @classmethod
    def from_pb(cls, msg: pb.RankIdentity) -> RankIdentity:
        return cls(job_id=msg.job_id, job_name=msg.job_name, rank=msg.rank, local_rank=msg.local_rank,
                   world_size=msg.world_size, local_size=msg.local_size, device=msg.device, pid=msg.pid,
                   node=msg.node, framework=msg.framework)
