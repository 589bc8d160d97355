"""The group_async batch sampler: an epoch's samples shared among groups by pace, boundaries for regrouping.

Each rank takes batches of ``global_batch // world`` samples. Epoch 0 starts
with ``profile_steps`` steps on every rank alike (the profiling stage); then,
and at the start of every later epoch, :meth:`GroupRuntime.boundary` mixes
the groups' models, measures every rank's pace, regroups if asked, and gives
each group a number of steps in proportion to its pace, so that all groups
reach the end of the epoch together and nobody waits long at the next
boundary. Inside a group, rank ``i`` of ``n`` takes every ``n``-th batch of
the group's share. When its share is done, a group parks at the service, so
that nobody waits on it while it waits at the boundary.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .runtime import GroupRuntime

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
        """Steps of this rank's group in the current epoch (the even split until the first boundary)."""
        rt = self.runtime
        if self._steps is None:
            return self.length // (rt.world * self.batch)
        return self._steps[rt.group_index]

    def __iter__(self) -> Iterator[list[int]]:
        rt, b = self.runtime, self.batch
        order = self._permutation()
        offset = 0
        profile = rt.config.profile_steps if not rt.started else 0
        if profile and (profile + 1) * rt.world * b <= self.length:
            self._steps = rt.boundary("start", self._epoch, self.length, b)
            for i in range(profile):
                start = (i * rt.world + rt.rank) * b
                yield order[start:start + b]
            offset = profile * rt.world * b
            self._steps = rt.boundary("profile", self._epoch, self.length - offset, b)
        else:
            self._steps = rt.boundary("start", self._epoch, self.length, b)
        rest = order[offset:]
        index = rt.group_index
        members = len(rt.group)
        mine = rt.group.index(rt.rank)
        start = sum(self._steps[g] * len(rt.groups[g]) * b for g in range(index))
        for step in range(self._steps[index]):
            at = start + (step * members + mine) * b
            yield rest[at:at + b]
        rt.park()
