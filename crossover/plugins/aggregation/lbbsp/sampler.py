"""A batch sampler whose per-rank batch sizes can change between global batches.

With LB-BSP (:mod:`crossover.plugins.aggregation.lbbsp.controller`) every rank processes a
different share ``b_i`` of each global batch of ``B = Σ b_i`` samples. This
sampler makes that work with an ordinary ``torch.utils.data.DataLoader``
(``batch_sampler=...``): all ranks draw the same per-epoch permutation (same
``seed`` and epoch), cut it into consecutive global batches, and rank ``i``
takes the contiguous slice ``[offset_i, offset_i + b_i)`` of each, where
``offset_i = b_0 + ... + b_{i-1}``. Every sample of an epoch is therefore
visited exactly once across ranks, however the sizes change.

The sizes are read from ``sizes`` once per global batch, just before its
indices are produced ("semi-dynamic"). For the ranks to agree, the source must
return the same list on every rank at the same global batch: feed it from a
:class:`~crossover.plugins.aggregation.lbbsp.controller.BatchSizeController` that every rank
updates at the same iteration, and give every rank the same DataLoader
settings (``num_workers``, ``prefetch_factor``), because a DataLoader draws
indices ahead of the training loop by a fixed number of batches.

The module needs no torch: a batch sampler only has to be iterable and sized.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Protocol, Union, runtime_checkable

from crossover.errors import CrossoverError
from crossover.plugins.aggregation.lbbsp.apportion import apportion
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.lbbsp.state import LBBSPState

__all__ = ["LBBSPSampler", "SamplerError", "SizeSource", "SupportsSizes", "WeightedBatchSampler"]

logger = logging.getLogger(__name__)


class SamplerError(CrossoverError, ValueError):
    """Bad sampler argument, or a size source returned an invalid assignment."""


@runtime_checkable
class SupportsSizes(Protocol):
    """Anything with a ``sizes`` attribute, e.g. a ``BatchSizeController``."""

    @property
    def sizes(self) -> Sequence[int]:
        """Current per-rank batch sizes."""
        ...


SizeSource = Union[Sequence[int], Callable[[], Sequence[int]], SupportsSizes]
"""A fixed list of sizes, a zero-argument callable, or an object with ``.sizes``."""


class WeightedBatchSampler:
    """Yields this rank's index list for each global batch of an epoch.

    Args:
        dataset_length: number of samples in the dataset.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        sizes: where to read the per-rank batch sizes (see :data:`SizeSource`);
            each read must return ``world_size`` non-negative ints with a
            positive sum (the global batch ``B``, which may also change).
        shuffle: permute the dataset each epoch (``random.Random(seed + epoch)``),
            otherwise take it in order.
        seed: shuffle seed; must be the same on every rank.
        drop_last: drop the final global batch when fewer than ``B`` samples
            remain. Otherwise that remainder ``R`` is split in proportion to
            the current sizes (largest remainder, ties to the lower rank),
            giving every rank at least one sample when ``R >= world_size``.
            When ``R < world_size`` some ranks get an empty batch: they are
            still yielded (``[]``) so that all ranks run the same number of
            steps, which needs a ``collate_fn`` and a training step that
            accept an empty batch; use ``drop_last=True`` otherwise.
    """

    def __init__(
        self,
        dataset_length: int,
        rank: int,
        world_size: int,
        sizes: SizeSource,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if dataset_length < 0:
            raise SamplerError(f"dataset_length must be >= 0, got {dataset_length}")
        if world_size < 1:
            raise SamplerError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise SamplerError(f"rank {rank} is outside [0, {world_size})")
        self._length = dataset_length
        self._rank = rank
        self._world_size = world_size
        self._sizes = sizes
        self._shuffle = shuffle
        self._seed = seed
        self._drop_last = drop_last
        self._epoch = 0
        self._read_sizes()  # fail early on a bad source

    @property
    def epoch(self) -> int:
        """The epoch whose permutation the next iteration uses."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``; call it on every rank before each epoch."""
        self._epoch = epoch

    def _read_sizes(self) -> list[int]:
        source = self._sizes
        if isinstance(source, SupportsSizes):
            raw = source.sizes
        elif callable(source):
            raw = source()
        else:
            raw = source
        sizes = list(raw)
        if (
            len(sizes) != self._world_size
            or any(not isinstance(size, int) or isinstance(size, bool) or size < 0 for size in sizes)
            or sum(sizes) < 1
        ):
            raise SamplerError(
                f"sizes must be {self._world_size} non-negative ints with a positive sum, got {sizes}"
            )
        return sizes

    def _permutation(self) -> list[int]:
        order = list(range(self._length))
        if self._shuffle:
            random.Random(self._seed + self._epoch).shuffle(order)
        return order

    def _split_remainder(self, remaining: int, sizes: Sequence[int]) -> list[int]:
        """Split a short final batch in proportion to ``sizes`` (zero sizes stay zero)."""
        active = [rank for rank, size in enumerate(sizes) if size > 0]
        floor = 1 if remaining >= len(active) else 0
        shares = apportion(remaining, [float(sizes[r]) for r in active], [floor] * len(active))
        split = [0] * len(sizes)
        for rank, share in zip(active, shares):
            split[rank] = share
        return split

    def __iter__(self) -> Iterator[list[int]]:
        order = self._permutation()
        position = 0
        while position < self._length:
            sizes = self._read_sizes()
            remaining = self._length - position
            total = sum(sizes)
            if remaining < total:
                if self._drop_last:
                    return
                logger.debug("final global batch: %d samples split over %s", remaining, sizes)
                sizes = self._split_remainder(remaining, sizes)
                total = remaining
            offset = position + sum(sizes[: self._rank])
            yield order[offset : offset + sizes[self._rank]]
            position += total

    def __len__(self) -> int:
        """Number of global batches in an epoch if the sizes stay as they are now.

        An estimate when the global batch changes during the epoch.
        """
        total = sum(self._read_sizes())
        full, rest = divmod(self._length, total)
        return full if self._drop_last or rest == 0 else full + 1


class LBBSPSampler:
    """``DataLoader(batch_sampler=...)`` for LB-BSP: this rank's slice of every global batch.

    A thin wrapper around :class:`WeightedBatchSampler`
    fed by the adopted LB-BSP sizes; it also records each batch's
    ``(b_i, B)`` so the weighted optimizer scales the gradient of exactly
    the batch that produced it, even when a DataLoader with workers draws
    indices ahead. Under any rule other than ``weighted`` the sizes never
    change, so the sampler is then a plain even split of each global batch.
    """

    def __init__(self, state: LBBSPState, *, shuffle: bool, seed: int, drop_last: bool) -> None:
        self._state = state
        self._inner = WeightedBatchSampler(
            state.dataset_length, state.rank, state.world_size, lambda: state.sizes,
            shuffle=shuffle, seed=seed, drop_last=drop_last,
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The current per-rank batch sizes."""
        return self._state.sizes

    @property
    def controller(self) -> BatchSizeController:
        return self._state.controller

    def stats(self) -> dict[str, Any]:
        """This sampler's sizes, their history and the controller's cost (see ``aggregation.lbbsp_stats``)."""
        return self._state.stats()

    @property
    def epoch(self) -> int:
        return self._inner.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``; call it on every rank before each epoch."""
        self._inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[list[int]]:
        state = self._state
        state.pending.clear()  # batches of an abandoned iteration will never be trained on
        position = 0
        for indices in self._inner:
            # The inner sampler read state.sizes just before yielding and
            # nothing ran in between, so this is the split of this very batch.
            batch_total = min(sum(state.sizes), state.dataset_length - position)
            position += batch_total
            state.pending.append((len(indices), batch_total))
            yield indices
