"""Adasum: the pairwise rule, the reference tree, and both distributed algorithms
run over an in-process fake of the collectives (one thread per rank)."""
from __future__ import annotations

import pytest
import torch
from fake_collectives import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.plugins.aggregation.adasum.algorithms import (
    AdasumError,
    adasum_allreduce,
    adasum_allreduce_tensors,
    adasum_pair,
    adasum_reference,
    adasum_tree,
)

ALGORITHMS = ["allgather", "recursive_doubling"]


class GatherOnly:
    """Collectives without ``exchange``."""

    rank = 0
    size = 2

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, tensor])


def rel_err(result: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (result.to(torch.float64) - expected).norm()
    return float(diff / expected.norm())


def correlated(size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Gradients sharing a common direction plus per-rank noise (a realistic mix)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator, dtype=torch.float64)
    return [
        (base + 0.7 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
        for _ in range(size)
    ]


# --- the pairwise rule ------------------------------------------------------

def test_orthogonal_vectors_are_summed() -> None:
    g1 = torch.tensor([3.0, 0.0, 0.0])
    g2 = torch.tensor([0.0, -2.0, 5.0])
    assert torch.equal(adasum_pair(g1, g2), g1 + g2)


def test_identical_vectors_give_the_same_vector() -> None:
    g = torch.tensor([[1.5, -2.0], [0.25, 4.0]])
    assert torch.allclose(adasum_pair(g, g), g, rtol=0, atol=1e-6)


def test_parallel_vectors_give_their_mean() -> None:
    g = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    assert torch.allclose(adasum_pair(g, 3 * g), 2 * g, rtol=1e-12, atol=0)


def test_zero_side_returns_the_other_without_nan() -> None:
    g = torch.tensor([1.0, -2.0, 3.0])
    zero = torch.zeros(3)
    assert torch.equal(adasum_pair(zero, g), g)
    assert torch.equal(adasum_pair(g, zero), g)
    assert torch.equal(adasum_pair(zero, zero), zero)


def test_pair_keeps_dtype_and_shape() -> None:
    g1 = torch.randn(2, 3, dtype=torch.float16)
    g2 = torch.randn(2, 3, dtype=torch.float16)
    out = adasum_pair(g1, g2)
    assert out.dtype == torch.float16 and out.shape == (2, 3)


@pytest.mark.parametrize(
    ("g1", "g2"),
    [
        (torch.zeros(3), torch.zeros(4)),
        (torch.zeros(3), torch.zeros(3, dtype=torch.float64)),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
    ],
)
def test_pair_rejects_mismatched_inputs(g1: torch.Tensor, g2: torch.Tensor) -> None:
    with pytest.raises(AdasumError):
        adasum_pair(g1, g2)


_vectors = st.lists(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=64), min_size=1, max_size=8
)


@settings(max_examples=60, deadline=None)
@given(_vectors, st.data())
def test_pair_is_symmetric(values: list[float], data: st.DataObject) -> None:
    other = data.draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=len(values), max_size=len(values)))
    g1 = torch.tensor(values, dtype=torch.float64)
    g2 = torch.tensor(other, dtype=torch.float64)
    out = adasum_pair(g1, g2)
    assert torch.equal(out, adasum_pair(g2, g1))
    assert not torch.isnan(out).any()


@settings(max_examples=60, deadline=None)
@given(_vectors, _vectors)
def test_pair_of_disjoint_supports_is_the_sum(left: list[float], right: list[float]) -> None:
    g1 = torch.tensor(left + [0.0] * len(right), dtype=torch.float64)
    g2 = torch.tensor([0.0] * len(left) + right, dtype=torch.float64)
    assert torch.equal(adasum_pair(g1, g2), g1 + g2)


# --- the tree and the reference ---------------------------------------------

def test_tree_shapes() -> None:
    assert adasum_tree(1) == []
    assert adasum_tree(2) == [[(0, 1)]]
    assert adasum_tree(3) == [[(0, 2)], [(0, 1)]]
    assert adasum_tree(4) == [[(0, 1), (2, 3)], [(0, 2)]]
    assert adasum_tree(6) == [[(0, 4), (1, 5)], [(0, 1), (2, 3)], [(0, 2)]]
    with pytest.raises(AdasumError):
        adasum_tree(0)


def test_reference_hand_computed_three_ranks() -> None:
    # fold: adasum([1,0], [1,1]) = 0.5*[1,0] + 0.75*[1,1] = [1.25, 0.75]
    # then adasum([1.25,0.75], [0,1]): dot .75, |a|^2 2.125, |b|^2 1
    #   -> (14/17)*[1.25, .75] + (5/8)*[0, 1] = [35/34, 169/136]
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    out = adasum_reference(grads)
    assert out.dtype == torch.float64
    assert torch.allclose(out, torch.tensor([35 / 34, 169 / 136], dtype=torch.float64), rtol=1e-15)


def test_reference_orthonormal_and_identical_four_ranks() -> None:
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.equal(adasum_reference(list(eye)), torch.ones(4, dtype=torch.float64))
    g = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    assert torch.allclose(adasum_reference([g] * 4), g, rtol=1e-15, atol=0)


def test_reference_single_rank_and_errors() -> None:
    g = torch.tensor([1.0, 2.0])
    assert torch.equal(adasum_reference([g]), g.double())
    with pytest.raises(AdasumError):
        adasum_reference([])
    with pytest.raises(AdasumError):
        adasum_reference([torch.zeros(2), torch.zeros(3)])


# --- distributed --------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_allreduce_matches_reference(
    algorithm: str, size: int, dtype: torch.dtype, tolerance: float
) -> None:
    grads = correlated(size, (7, 33), dtype, seed=size)
    expected = adasum_reference(grads)
    results, _ = run_ranks(size, lambda c: adasum_allreduce(grads[c.rank], c, algorithm=algorithm))
    for result in results:
        assert isinstance(result, torch.Tensor)
        assert result.dtype == dtype and result.shape == (7, 33)
        assert rel_err(result, expected) <= tolerance
        assert torch.equal(result, results[0])  # every rank holds the same bits


def test_exchange_round_counts() -> None:
    grads = correlated(6, (10,), torch.float32, seed=1)
    _, world = run_ranks(6, lambda c: adasum_allreduce(grads[c.rank], c, algorithm="recursive_doubling"))
    assert world.calls["exchange"] == 2 + 2  # fold, log2(4) butterfly rounds, unfold
    _, world = run_ranks(6, lambda c: adasum_allreduce(grads[c.rank], c))
    assert world.calls == {"allgather": 1, "exchange": 0}


def test_allreduce_single_rank_returns_a_copy() -> None:
    g = torch.tensor([1.0, 2.0])
    results, _ = run_ranks(1, lambda c: adasum_allreduce(g, c))
    assert torch.equal(results[0], g) and results[0] is not g


def test_recursive_doubling_needs_exchange() -> None:
    with pytest.raises(AdasumError, match="exchange"):
        adasum_allreduce(torch.ones(3), GatherOnly(), algorithm="recursive_doubling")
    with pytest.raises(AdasumError, match="unknown"):
        adasum_allreduce(torch.ones(3), GatherOnly(), algorithm="ring")  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_tensor_list_is_reduced_per_tensor(algorithm: str) -> None:
    size = 3
    shapes = [(4, 5), (5,), (), (2, 2, 2)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float64]
    per_rank = [
        [correlated(size, shape, dtype, seed=10 + i)[r] for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
        for r in range(size)
    ]
    # make one tensor's rank-1 copy huge: per-tensor coefficients must not leak across tensors
    per_rank[1][1] = per_rank[1][1] * 1000
    results, world = run_ranks(
        size, lambda c: adasum_allreduce_tensors(per_rank[c.rank], c, algorithm=algorithm)
    )
    if algorithm == "allgather":
        assert world.calls["allgather"] == 2  # one per (dtype, device) fusion group
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        expected = adasum_reference([per_rank[r][index] for r in range(size)])
        for rank_results in results:
            assert isinstance(rank_results, list)
            out = rank_results[index]
            assert out.shape == shape and out.dtype == dtype
            assert rel_err(out, expected) <= (1e-4 if dtype == torch.float32 else 1e-6)


def test_tensor_list_empty() -> None:
    results, _ = run_ranks(2, lambda c: adasum_allreduce_tensors([], c))
    assert results == [[], []]
