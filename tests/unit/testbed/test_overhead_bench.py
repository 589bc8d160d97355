"""bench.overhead's command line: the CPU list `--daemon-cpus` takes."""
from __future__ import annotations

import argparse

import pytest

from bench.overhead import _cpu_list


@pytest.mark.parametrize("text, cpus", [("1", {1}), ("0,2", {0, 2}), ("2-3", {2, 3}), ("0,4-5", {0, 4, 5})])
def test_a_cpu_list_names_cpus_and_ranges(text: str, cpus: set[int]) -> None:
    assert _cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["", "one", "1-", "3-1"])
def test_a_cpu_list_that_is_not_one_is_refused_in_a_line(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="cpu list|no CPU|range"):
        _cpu_list(text)
