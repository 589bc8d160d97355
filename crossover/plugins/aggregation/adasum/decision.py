"""Which Adasum implementation runs an optimizer (Horovod's native one or the plugin's), and which algorithm."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from crossover.plugins.aggregation.adasum.algorithms import AdasumAlgorithm
from crossover.plugins.aggregation.selection import AggregationError
from crossover.settings import ADASUM_ALGORITHMS, ADASUM_IMPLS

__all__ = ["AdasumDecision", "AdasumFacts", "adasum_path", "resolve_algorithm"]

_AUTO_ALLGATHER_MAX_RANKS = 8


@dataclass(frozen=True)
class AdasumFacts:
    """What decides whether Horovod's native Adasum can run this optimizer.

    Attributes:
        size: ranks that combine gradients (the process set's size).
        global_set: whether the optimizer uses Horovod's global process set.
        mpi_enabled: ``hvd.mpi_enabled()``: the MPI controller runs (Horovod
            registers its Adasum operation only then; under Gloo it raises
            "No Adasum operation enabled").
        cuda: parameters live on a GPU.
        nccl_built: ``hvd.nccl_built()``: GPU Adasum is then hierarchical
            (NCCL averaging inside a node, Adasum across nodes).
        local_size: ranks on this node.
        homogeneous: ``hvd.is_homogeneous()``: every node has as many ranks.
    """

    size: int
    global_set: bool
    mpi_enabled: bool
    cuda: bool = False
    nccl_built: bool = False
    local_size: int = 1
    homogeneous: bool = True


@dataclass(frozen=True)
class AdasumDecision:
    """Which Adasum implementation runs, and why (logged once per optimizer)."""

    path: Literal["native", "plugin"]
    reason: str


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def adasum_path(facts: AdasumFacts, impl: str = "auto") -> AdasumDecision:
    """Choose native or plugin Adasum; ``impl="native"`` raises where native cannot run."""
    if impl not in ADASUM_IMPLS:
        raise AggregationError(f"unknown adasum_impl {impl!r}; use one of {', '.join(ADASUM_IMPLS)}")
    blocker = None
    if not facts.mpi_enabled:
        blocker = "Horovod's Adasum needs the MPI controller (horovodrun --mpi / mpirun); this job runs without it"
    elif not facts.global_set:
        blocker = "Horovod's Adasum does not support process sets"
    elif facts.cuda and facts.nccl_built:  # hierarchical: NCCL inside a node, Adasum across nodes
        nodes, rest = divmod(facts.size, max(1, facts.local_size))
        if rest or not facts.homogeneous or not _power_of_two(nodes):
            blocker = (f"Horovod's GPU Adasum needs a power-of-two number of equally sized nodes, "
                       f"got {facts.size} ranks with {facts.local_size} on this node")
    elif not _power_of_two(facts.size):
        blocker = f"Horovod's Adasum needs a power-of-two number of ranks, this group has {facts.size}"
    if facts.size == 1:
        blocker = None  # Horovod then builds a plain optimizer; nothing to combine
    if impl == "plugin":
        return AdasumDecision("plugin", "CROSSOVER_ADASUM_IMPL=plugin")
    if blocker is None:
        return AdasumDecision("native", "MPI controller, global process set, power-of-two ranks")
    if impl == "native":
        raise AggregationError(f"{blocker}; unset CROSSOVER_ADASUM_IMPL (or use 'auto') to run the plugin's Adasum")
    return AdasumDecision("plugin", blocker)


def resolve_algorithm(algorithm: str, size: int) -> AdasumAlgorithm:
    """``auto`` → ``allgather`` up to 8 ranks, ``recursive_doubling`` beyond."""
    if algorithm == "auto":
        return "allgather" if size <= _AUTO_ALLGATHER_MAX_RANKS else "recursive_doubling"
    if algorithm in ("allgather", "recursive_doubling"):
        return algorithm  # type: ignore[return-value]
    raise AggregationError(f"unknown Adasum algorithm {algorithm!r}; use one of {', '.join(ADASUM_ALGORITHMS)}")
