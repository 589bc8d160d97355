"""bench.gpu.handover's pure part: which gaps a run of two processes' turns has."""
from __future__ import annotations

from bench.gpu.handover import gaps


def test_only_a_change_of_process_is_a_hand_over() -> None:
    a = [(0, 10), (40, 50)]
    b = [(12, 30), (55, 70)]
    assert gaps(a, b) == [(2, 0, 2), (10, 2, 1), (5, 1, 3)]


def test_a_process_twice_in_a_row_has_no_gap_between_its_turns() -> None:
    assert gaps([(0, 10), (11, 20)], [(25, 30)]) == [(5, 1, 2)]


def test_overlapping_turns_give_a_negative_gap() -> None:
    assert gaps([(0, 10)], [(8, 20)]) == [(-2, 0, 1)]
