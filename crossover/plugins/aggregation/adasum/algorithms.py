"""Adasum: adaptive summation of gradients (Maleki et al., MLSys 2021).

Adasum combines two gradients (or, as Horovod does, two optimizer deltas) so
that orthogonal vectors are summed and parallel vectors are averaged::

    adasum(g1, g2) = (1 - g1·g2 / (2‖g1‖²))·g1 + (1 - g1·g2 / (2‖g2‖²))·g2

Why we carry our own implementation instead of relying on ``hvd.Adasum``:
Horovod's native Adasum only exists under the MPI controller, only for the
global process set and only for power-of-two world sizes. The functions here
run over any collective backend that implements the small :class:`Collectives`
protocol (Horovod's Gloo collectives, a process-set subgroup, or an in-process
fake in tests) and for any number of ranks.

**Reduction tree.** For ``n`` ranks let ``p`` be the largest power of two
``<= n``. :func:`adasum_tree` returns the rounds of the tree:

1. *fold* (only when ``n`` is not a power of two): every extra rank
   ``r in [p, n)`` is absorbed by its partner ``r - p``:
   ``v[r - p] = adasum(v[r - p], v[r])``;
2. *butterfly*: for distances ``d = 1, 2, 4, ... p/2`` the pairs
   ``(i, i + d)`` with ``i`` a multiple of ``2d`` are combined,
   ``v[i] = adasum(v[i], v[i + d])``, i.e. ``(0,1), (2,3), ...`` then
   ``(01, 23), ...`` as in Horovod's own reference tree.

The result is ``v[0]``. The lower-index operand is always the first argument.
For power-of-two counts this is exactly Horovod's tree; the fold is the
classic "fold into a power of two" of recursive-doubling allreduce. The tree is
deliberately defined once, here, and used by :func:`adasum_reference` and by
both distributed algorithms, so they compute the same thing.

**Granularity.** Adasum is applied per tensor (per parameter), as Horovod does
even when it fuses tensors into one buffer: :func:`adasum_allreduce_tensors`
fuses for communication but keeps per-tensor coefficients.

**Numerics.** Dot products and squared norms are accumulated in float64 (as in
Horovod's C++ kernel); the combination is also done in float64 and the result
is cast back to the input dtype. A zero-norm operand contributes nothing and
leaves the other operand unchanged (its coefficient would be 0/0). Horovod's
kernel uses a ``‖g‖² < 1e-8`` threshold instead of ``== 0``; that threshold
turns small but non-zero gradients into a plain sum, which we do not copy.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Optional, Protocol

import torch

from crossover.errors import CrossoverError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "AdasumAlgorithm",
    "AdasumError",
    "Collectives",
    "PairwiseCollectives",
    "adasum_allreduce",
    "adasum_allreduce_tensors",
    "adasum_pair",
    "adasum_reference",
    "adasum_tree",
]

logger = logging.getLogger(__name__)

AdasumAlgorithm = Literal["allgather", "recursive_doubling"]
"""How :func:`adasum_allreduce` moves data between ranks.

``"allgather"``: one allgather, then every rank reduces the whole tree
locally. Each rank receives ``(size - 1) × tensor`` bytes and holds ``size``
copies in memory: simple, one collective call, fine for small groups.

``"recursive_doubling"``: ``log2(p) + 2`` pairwise exchange rounds (two of them
only when the size is not a power of two); each rank sends and receives about
``log2(size) × tensor`` bytes and holds two copies. Needs
:class:`PairwiseCollectives`. Horovod's native kernel does better still
(vector halving, distance doubling: ``~2 × tensor`` bytes per rank).
"""


class AdasumError(CrossoverError, ValueError):
    """Inputs to an Adasum function do not fit together (shape, dtype, size)."""


class Collectives(Protocol):
    """The one collective primitive the allgather algorithm needs.

    Every rank of the group calls the same collective methods in the same
    order with tensors of the same shape and dtype; this is what allows the
    functions below to be run over Horovod, ``torch.distributed`` or an
    in-process fake alike.
    """

    @property
    def rank(self) -> int:
        """This process's index in the group, ``0 <= rank < size``."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def allgather(self, tensor: Tensor) -> Tensor:
        """Return every rank's ``tensor`` stacked along a new dim 0, in rank order.

        The result has shape ``(size, *tensor.shape)`` and ``tensor.dtype``.
        """
        ...


class PairwiseCollectives(Collectives, Protocol):
    """Adds a collective pairwise exchange, for the recursive-doubling algorithm."""

    def exchange(
        self, tensor: Optional[Tensor], send_to: Optional[int], recv_from: Optional[int]
    ) -> Optional[Tensor]:
        """One collective round of point-to-point transfers.

        Every rank calls it once per round (a rank with nothing to do passes
        ``None, None, None``), sends ``tensor`` to ``send_to`` when given and
        returns the tensor received from ``recv_from`` (``None`` when not
        given). Received tensors have the shape and dtype of the sent ones.
        Over Horovod, one round is one ``alltoall`` whose splits are non-zero
        only towards ``send_to``.
        """
        ...


def adasum_tree(size: int) -> list[list[tuple[int, int]]]:
    """Return the rounds of the Adasum reduction tree over ``size`` ranks.

    Each round is a list of ``(keep, absorb)`` pairs meaning
    ``v[keep] = adasum(v[keep], v[absorb])``; pairs within one round are
    independent. The final value is ``v[0]``. See the module docstring for the
    shape of the tree (fold of the ranks beyond the largest power of two, then
    a butterfly).
    """
    if size < 1:
        raise AdasumError(f"size must be >= 1, got {size}")
    pow2 = 1 << (size.bit_length() - 1)
    rounds: list[list[tuple[int, int]]] = []
    if size > pow2:
        rounds.append([(rank - pow2, rank) for rank in range(pow2, size)])
    distance = 1
    while distance < pow2:
        rounds.append([(i, i + distance) for i in range(0, pow2, 2 * distance)])
        distance *= 2
    return rounds


def _check_floating(tensor: Tensor, what: str) -> None:
    if not tensor.is_floating_point():
        raise AdasumError(f"{what} must be a floating-point tensor, got dtype {tensor.dtype}")


def _pair64(a: Tensor, b: Tensor) -> Tensor:
    """The pairwise rule on same-shaped tensors, computed and returned in float64.

    Uses ``torch.where`` rather than a Python branch so that no device-to-host
    synchronisation happens on GPU tensors.
    """
    a64 = a.to(torch.float64).reshape(-1)
    b64 = b.to(torch.float64).reshape(-1)
    dot = torch.dot(a64, b64)
    anorm = torch.dot(a64, a64)
    bnorm = torch.dot(b64, b64)
    one = torch.ones((), dtype=torch.float64, device=a64.device)
    # A zero-norm side is the zero vector: its coefficient does not matter, and
    # the other coefficient is then exactly 1 (dot == 0), so we return the other.
    acoeff = torch.where(anorm > 0, 1.0 - dot / (2.0 * torch.where(anorm > 0, anorm, one)), one)
    bcoeff = torch.where(bnorm > 0, 1.0 - dot / (2.0 * torch.where(bnorm > 0, bnorm, one)), one)
    return (acoeff * a64 + bcoeff * b64).reshape(a.shape)


def _check_pair(g1: Tensor, g2: Tensor) -> None:
    _check_floating(g1, "g1")
    _check_floating(g2, "g2")
    if g1.shape != g2.shape:
        raise AdasumError(f"shapes differ: {tuple(g1.shape)} vs {tuple(g2.shape)}")
    if g1.dtype != g2.dtype:
        raise AdasumError(f"dtypes differ: {g1.dtype} vs {g2.dtype}")


def adasum_pair(g1: Tensor, g2: Tensor) -> Tensor:
    """Combine two same-shaped, same-dtype floating tensors with the Adasum rule.

    Symmetric in its arguments; orthogonal inputs give ``g1 + g2``, identical
    inputs give ``g1``, and a zero input returns the other one. Reductions and
    the combination run in float64; the result has the inputs' dtype.
    """
    _check_pair(g1, g2)
    return _pair64(g1, g2).to(g1.dtype)


def _reduce_tree64(values: list[Tensor]) -> Tensor:
    """Apply :func:`adasum_tree` to ``values`` (any float dtype); float64 result."""
    work = list(values)
    for round_pairs in adasum_tree(len(work)):
        for keep, absorb in round_pairs:
            work[keep] = _pair64(work[keep], work[absorb])
    return work[0].to(torch.float64)


def adasum_reference(grads: Sequence[Tensor]) -> Tensor:
    """Reference Adasum of one tensor per rank, in float64, over :func:`adasum_tree`.

    Every intermediate stays in float64, which makes this the yardstick for
    the distributed algorithms. Returns a float64 tensor of the inputs' shape.
    """
    if len(grads) == 0:
        raise AdasumError("adasum_reference needs at least one tensor")
    first = grads[0]
    for index, grad in enumerate(grads):
        _check_floating(grad, f"grads[{index}]")
        if grad.shape != first.shape:
            raise AdasumError(
                f"grads[{index}] has shape {tuple(grad.shape)}, grads[0] has {tuple(first.shape)}"
            )
    return _reduce_tree64(list(grads))


def _check_group(collectives: Collectives) -> tuple[int, int]:
    rank, size = collectives.rank, collectives.size
    if size < 1 or not 0 <= rank < size:
        raise AdasumError(f"invalid collectives: rank {rank}, size {size}")
    return rank, size


def _segments_pair64(a: Tensor, b: Tensor, lengths: Sequence[int]) -> Tensor:
    """Per-segment Adasum of two flat buffers; float64 flat result.

    Segments are reduced one by one with plain reductions (no scatter/atomic
    ops), so the same inputs give bit-identical results on every rank of a
    homogeneous group.
    """
    parts = []
    start = 0
    for length in lengths:
        parts.append(_pair64(a.narrow(0, start, length), b.narrow(0, start, length)))
        start += length
    return torch.cat(parts) if parts else a.new_zeros(0, dtype=torch.float64)


def _allgather_flat(flat: Tensor, lengths: Sequence[int], collectives: Collectives) -> Tensor:
    size = collectives.size
    gathered = collectives.allgather(flat)
    if tuple(gathered.shape) != (size, flat.numel()):
        raise AdasumError(
            f"allgather returned shape {tuple(gathered.shape)}, expected {(size, flat.numel())}"
        )
    work = list(gathered.unbind(0))
    for round_pairs in adasum_tree(size):
        for keep, absorb in round_pairs:
            work[keep] = _segments_pair64(work[keep], work[absorb], lengths)
    return work[0].to(flat.dtype)


def _recursive_doubling_flat(
    flat: Tensor, lengths: Sequence[int], collectives: PairwiseCollectives
) -> Tensor:
    """Recursive doubling over :func:`adasum_tree`; intermediates in the input dtype.

    After the butterfly round with distance ``d`` every rank of an aligned
    block of ``2d`` ranks holds the value the tree holds at the block's first
    index, because both partners compute ``adasum(lower, upper)`` in the same
    operand order. Every rank takes part in every round (idle ranks exchange
    nothing) because an exchange round is a collective call.
    """
    rank, size = _check_group(collectives)
    pow2 = 1 << (size.bit_length() - 1)
    extra = size - pow2
    dtype = flat.dtype
    value = flat

    def received(tensor: Optional[Tensor], peer: int) -> Tensor:
        if tensor is None or tensor.shape != flat.shape:
            got = None if tensor is None else tuple(tensor.shape)
            raise AdasumError(f"exchange from rank {peer} returned {got}, expected {tuple(flat.shape)}")
        return tensor

    if extra:  # fold: ranks [pow2, size) hand their tensor to rank - pow2
        if rank >= pow2:
            collectives.exchange(value, rank - pow2, None)
        elif rank < extra:
            other = received(collectives.exchange(None, None, rank + pow2), rank + pow2)
            value = _segments_pair64(value, other, lengths).to(dtype)
        else:
            collectives.exchange(None, None, None)

    distance = 1
    while distance < pow2:
        if rank < pow2:
            peer = rank ^ distance
            other = received(collectives.exchange(value, peer, peer), peer)
            lower, upper = (value, other) if rank < peer else (other, value)
            value = _segments_pair64(lower, upper, lengths).to(dtype)
        else:
            collectives.exchange(None, None, None)
        distance *= 2

    if extra:  # unfold: partners return the result to the folded ranks
        if rank < extra:
            collectives.exchange(value, rank + pow2, None)
        elif rank >= pow2:
            value = received(collectives.exchange(None, None, rank - pow2), rank - pow2)
        else:
            collectives.exchange(None, None, None)
    return value


def _reduce_flat(
    flat: Tensor, lengths: Sequence[int], collectives: Collectives, algorithm: AdasumAlgorithm
) -> Tensor:
    _, size = _check_group(collectives)
    if size == 1:
        return flat.clone()
    if algorithm == "allgather":
        return _allgather_flat(flat, lengths, collectives)
    if algorithm == "recursive_doubling":
        if not callable(getattr(collectives, "exchange", None)):
            raise AdasumError("algorithm 'recursive_doubling' needs collectives with exchange()")
        return _recursive_doubling_flat(flat, lengths, collectives)  # type: ignore[arg-type]
    raise AdasumError(f"unknown Adasum algorithm {algorithm!r}; use 'allgather' or 'recursive_doubling'")


def adasum_allreduce(
    tensor: Tensor, collectives: Collectives, *, algorithm: AdasumAlgorithm = "allgather"
) -> Tensor:
    """Adasum-reduce one tensor across the group; every rank gets the result.

    Must be called by every rank of ``collectives`` with a tensor of the same
    shape and dtype. The result equals :func:`adasum_reference` over all ranks'
    tensors (cast to ``tensor.dtype``; with ``"recursive_doubling"``
    intermediates are rounded to that dtype too). A new tensor is returned;
    the input is not modified.
    """
    _check_floating(tensor, "tensor")
    flat = tensor.reshape(-1)
    return _reduce_flat(flat, [flat.numel()], collectives, algorithm).reshape(tensor.shape)


def adasum_allreduce_tensors(
    tensors: Sequence[Tensor], collectives: Collectives, *, algorithm: AdasumAlgorithm = "allgather"
) -> list[Tensor]:
    """Per-tensor Adasum of a list of tensors, as Horovod applies it to parameters.

    Tensors with the same dtype and device are fused into one flat buffer so
    the group makes one collective call (or one set of exchange rounds) per
    fusion group, while the Adasum coefficients stay per tensor. Every rank
    must pass tensors of the same shapes and dtypes in the same order.
    Returns new tensors in the input order.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        _check_floating(tensor, f"tensors[{index}]")
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    results: list[Optional[Tensor]] = [None] * len(tensors)
    for (dtype, device), indices in groups.items():
        lengths = [tensors[i].numel() for i in indices]
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        logger.debug(
            "adasum fusion group dtype=%s device=%s: %d tensors, %d elements",
            dtype, device, len(indices), flat.numel(),
        )
        reduced = _reduce_flat(flat, lengths, collectives, algorithm)
        start = 0
        for index, length in zip(indices, lengths):
            results[index] = reduced.narrow(0, start, length).reshape(tensors[index].shape)
            start += length
    # every index belongs to exactly one fusion group, so no slot is left None
    return [result for result in results if result is not None]
