"""What every workload leaves behind: one JSON summary per rank, with a digest of its parameters."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

__all__ = ["model_digest", "timed_summary", "write_rank_summary"]


def model_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters and buffers, in name order: equal digests mean bit-identical models."""
    digest = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        digest.update(t.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def write_rank_summary(out: str | None, rank: int, summary: dict[str, Any]) -> None:
    """Write `OUT/rank{rank}.json`; without an `out` directory nothing is written."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(summary, f)


def timed_summary(network: torch.nn.Module, batch: int, starts: list[float], ends: list[float], losses: list[float],
                  rank: int | None = None, size: int | None = None, **extra: Any) -> dict[str, Any]:
    """A benchmark rank's summary: who it was, its network's size, and when each iteration began and ended
    (`time.monotonic()`, the daemons' clock), with `extra` fields of the workload's own. `rank` and `size` are
    Horovod's unless given (a DDP rank gives its process group's)."""
    if rank is None or size is None:
        import horovod.torch as hvd

        rank, size = hvd.rank(), hvd.size()
    return {"rank": rank, "size": size, "batch": batch, "pid": os.getpid(), **extra,
            "params": sum(p.numel() for p in network.parameters()),
            "iter_start": starts, "iter_end": ends, "losses": losses,
            "job_name": os.environ.get("CROSSOVER_JOB_NAME", "")}
