"""The group_async batch sampler: an epoch's samples shared among groups as they go, boundaries for regrouping.

Each rank takes batches of ``global_batch // world`` samples. At the start of
every epoch, :meth:`GroupRuntime.begin_epoch` plans each group's steps from
the ranks' measured paces (evenly before any were measured) and, while a
decision may still change, regroups at a global boundary. The plan lays the
epoch's permutation out in one region per group; inside a group, each step
takes the next ``n * batch`` samples of the region, cut among the ``n``
members by their shares (equal, or by measured pace: ``balance.py``). A group then steps until
the parameter service says all groups together have used up the epoch, so a
fast group runs on past its region (into the next one's, wrapping around)
while a stalled one takes less; without the service, it stops at its plan.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from crossover.plugins.aggregation.group_async.runtime import GroupRuntime

__all__ = ["GroupSampler"]


class GroupSampler:
    """``DataLoader(ds, batch_sampler=GroupSampler(...))``; every rank iterates it (a collective at boundaries)."""

    def __init__(self, runtime: GroupRuntime, dataset_length: int, global_batch: int, *, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.runtime = runtime
        self.length = dataset_length
        self.batch = max(1, global_batch // runtime.world)
        self.shuffle = shuffle
        self.seed = seed
        self._epoch = 0
        self._steps: list[int] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator()
        g.manual_seed(self.seed + self._epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def __len__(self) -> int:
        """The steps planned for this rank's group in the current epoch (the even split before any plan); with
        the service counting, the group may take more or fewer."""
        rt = self.runtime
        if self._steps is None:
            return self.length // (rt.world * self.batch)
        return self._steps[rt.group_index]

    def __iter__(self) -> Iterator[list[int]]:
        rt, b = self.runtime, self.batch
        rest = self._permutation()
        self._steps = rt.begin_epoch(self._epoch, self.length, b)
        index = rt.group_index
        shares = rt.shares  # fixed for the epoch: every member laid out the same cut
        mine = rt.group.index(rt.rank)
        size, within = shares[mine], sum(shares[:mine])
        start = sum(self._steps[g] * len(rt.groups[g]) * b for g in range(index))
        step = 0
        while not rt.epoch_done(step):
            at = start + step * sum(shares) + within
            yield [rest[(at + k) % len(rest)] for k in range(size)]
            step += 1
