"""Who a DDP rank is, from what `torchrun` tells its workers: the same job id on every node, unconfigured.

Pure: it reads a mapping (the environment), so the rules are tested without torch.

The job id, in order:
  * ``TORCHELASTIC_RUN_ID`` when it names the rendezvous (``--rdzv-id``, or the uuid that
    ``--standalone`` draws): identical on every node and across elastic restarts;
  * else, under torchrun's static rendezvous (run id ``none``), the rendezvous endpoint
    ``MASTER_ADDR:MASTER_PORT``: given on every node's command line, kept across restarts,
    and no two jobs listen on one endpoint at once;
  * else (no torchrun: `mp.spawn`, a scheduler's own launcher) nothing here: rank 0 draws
    one and hands it to the others through the process group's store (`ddp_torch`).
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TorchrunPlace", "job_id_from_env", "place_from_env"]


@dataclass(frozen=True)
class TorchrunPlace:
    """A worker's place in its job, as torchrun's variables give it."""

    rank: int
    local_rank: int
    world_size: int
    local_size: int
    restart: int  # TORCHELASTIC_RESTART_COUNT: how many times the agent restarted the workers


def job_id_from_env(env: Mapping[str, str]) -> str | None:
    """The job's id from torchrun's rendezvous, the same on every node; None outside torchrun."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return uuid.uuid5(uuid.NAMESPACE_URL, f"torchelastic://{run_id}").hex
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if run_id == "none" and addr and port:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"torchrun-static://{addr}:{port}").hex
    return None


def place_from_env(env: Mapping[str, str], rank: int, world_size: int) -> TorchrunPlace:
    """The rank's place: ``rank`` and ``world_size`` from its process group, the local ones from torchrun's
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``; without them the whole job is taken to run on this one node (a
    launcher-less run on one machine)."""
    def number(name: str, default: int) -> int:
        try:
            return int(env.get(name, ""))
        except ValueError:
            return default

    return TorchrunPlace(rank=rank, local_rank=number("LOCAL_RANK", rank), world_size=world_size,
                         local_size=number("LOCAL_WORLD_SIZE", world_size),
                         restart=number("TORCHELASTIC_RESTART_COUNT", 0))
