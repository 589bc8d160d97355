"""The test bed's event-log oracle: two jobs never compute on one device at once."""
from __future__ import annotations

from testbed.harness.oracles import overlaps


def test_overlaps_reports_only_pairs_of_different_jobs():
    a0, a1 = (0.0, 1.0, "a", 0), (0.1, 0.9, "a", 1)  # one job's ranks together: allowed
    b0 = (0.95, 2.0, "b", 0)  # starts while a0 still computes, after a1 ended
    assert overlaps([a0, a1]) == []
    assert overlaps([b0, a1, a0]) == [(a0, b0)]
    assert overlaps([a0, (1.0, 2.0, "b", 0)]) == []  # back to back is no overlap


def test_overlaps_sees_past_a_long_interval():
    long_a, short_a, b = (0.0, 5.0, "a", 0), (0.1, 0.2, "a", 1), (1.0, 2.0, "b", 0)
    assert overlaps([long_a, short_a, b]) == [(long_a, b)]
