"""WeightedBatchSampler: exactly-once coverage across ranks, changing sizes,
determinism, epochs, the final partial batch, and use with a DataLoader."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Optional

import pytest

from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig
from crossover.plugins.aggregation.lbbsp.controller import BatchSizeController
from crossover.plugins.aggregation.lbbsp.sampler import SamplerError, WeightedBatchSampler


class Schedule:
    """A size source that the test switches between global batches."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.value = list(sizes)

    def __call__(self) -> list[int]:
        return list(self.value)


def run_epoch(
    length: int,
    sizes: Sequence[int],
    *,
    changes: Optional[dict[int, Sequence[int]]] = None,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    shuffle: bool = True,
) -> list[list[list[int]]]:
    """Iterate all ranks in lockstep; ``changes[g]`` takes effect from global batch ``g``.

    Returns ``batches[g][rank]``.
    """
    source = Schedule(sizes)
    samplers = [
        WeightedBatchSampler(length, rank, len(sizes), source, seed=seed, drop_last=drop_last, shuffle=shuffle)
        for rank in range(len(sizes))
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    iterators = [iter(sampler) for sampler in samplers]
    batches: list[list[list[int]]] = []
    while True:
        if changes and len(batches) in changes:
            source.value = list(changes[len(batches)])
        step = [next(it, None) for it in iterators]
        if all(batch is None for batch in step):
            return batches
        assert all(batch is not None for batch in step), "ranks disagree on the number of steps"
        batches.append([batch for batch in step if batch is not None])


def all_indices(batches: list[list[list[int]]]) -> Counter:
    return Counter(index for step in batches for batch in step for index in batch)


@pytest.mark.parametrize(
    ("length", "sizes"),
    [(100, [5, 5]), (101, [1, 2, 5]), (97, [3, 0, 2, 7]), (10, [4, 4, 4]), (1, [2, 1]), (0, [3, 3])],
)
def test_every_sample_exactly_once(length: int, sizes: list[int]) -> None:
    batches = run_epoch(length, sizes)
    assert all_indices(batches) == Counter(range(length))
    for step in batches[:-1]:
        assert [len(batch) for batch in step] == sizes


def test_sizes_changing_mid_epoch() -> None:
    changes = {3: [2, 6, 2], 7: [1, 1, 1], 9: [8, 4, 3]}  # global batch 10, 10, 3, then 15
    batches = run_epoch(120, [4, 4, 2], changes=changes, seed=5)
    assert all_indices(batches) == Counter(range(120))
    assert [len(b) for b in batches[3]] == [2, 6, 2]
    assert [len(b) for b in batches[8]] == [1, 1, 1]
    assert [len(b) for b in batches[9]] == [8, 4, 3]


def test_slices_are_contiguous_in_rank_order() -> None:
    batches = run_epoch(20, [3, 5], shuffle=False)
    assert batches[0] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert batches[1] == [[8, 9, 10], [11, 12, 13, 14, 15]]


def test_final_partial_batch_split_proportionally() -> None:
    batches = run_epoch(20, [6, 2], shuffle=False)  # 8 + 8 + remainder 4 -> 3 : 1
    assert [len(b) for b in batches[-1]] == [3, 1]
    batches = run_epoch(18, [6, 2], shuffle=False)  # remainder 2: one each, nobody idle
    assert [len(b) for b in batches[-1]] == [1, 1]
    batches = run_epoch(17, [2, 2, 4], shuffle=False)  # remainder 1 < 3 ranks
    assert [len(b) for b in batches[-1]] == [0, 0, 1]
    assert all_indices(batches) == Counter(range(17))


def test_drop_last() -> None:
    batches = run_epoch(50, [4, 3], drop_last=True)
    assert len(batches) == 7
    assert sum(all_indices(batches).values()) == 49
    assert max(all_indices(batches).values()) == 1


def test_same_seed_same_batches_other_seed_differs() -> None:
    first = run_epoch(64, [5, 3], seed=42)
    assert run_epoch(64, [5, 3], seed=42) == first
    assert run_epoch(64, [5, 3], seed=43) != first


def test_epoch_reshuffles_and_still_covers() -> None:
    epoch0 = run_epoch(64, [5, 3], seed=1, epoch=0)
    epoch1 = run_epoch(64, [5, 3], seed=1, epoch=1)
    assert epoch0 != epoch1
    assert all_indices(epoch1) == Counter(range(64))
    sampler = WeightedBatchSampler(64, 0, 2, [5, 3], seed=1)
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and list(sampler) == [step[0] for step in epoch1]


def test_len() -> None:
    assert len(WeightedBatchSampler(100, 0, 2, [6, 4])) == 10
    assert len(WeightedBatchSampler(101, 0, 2, [6, 4])) == 11
    assert len(WeightedBatchSampler(101, 0, 2, [6, 4], drop_last=True)) == 10


def test_reads_sizes_from_a_controller() -> None:
    controller = BatchSizeController(BatchSizeConfig(global_batch=12, world_size=3))
    sampler = WeightedBatchSampler(30, 2, 3, controller, shuffle=False)
    assert next(iter(sampler)) == [8, 9, 10, 11]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sizes": [1, 2, 3]}, "sizes"),
        ({"sizes": [0, 0]}, "sizes"),
        ({"sizes": [2, -1]}, "sizes"),
        ({"rank": 2}, "rank 2"),
        ({"world_size": 0}, "world_size"),
        ({"dataset_length": -1}, "dataset_length"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"dataset_length": 10, "rank": 0, "world_size": 2, "sizes": [1, 1], **kwargs}
    with pytest.raises(SamplerError, match=message):
        WeightedBatchSampler(**args)


def test_with_a_dataloader() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.arange(40))
    seen = []
    for rank, sizes in enumerate([[3, 5], [3, 5]]):
        loader = DataLoader(dataset, batch_sampler=WeightedBatchSampler(40, rank, 2, sizes, seed=9))
        batches = [batch[0] for batch in loader]
        assert [len(b) for b in batches] == [sizes[rank]] * 5
        seen.extend(int(x) for b in batches for x in b)
    assert sorted(seen) == list(range(40))
