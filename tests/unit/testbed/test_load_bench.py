"""bench/load.py's pure helpers (bench/load_analysis.py): how sessions are spread and how its numbers are
derived, not how fast anything ran."""
from __future__ import annotations

import pytest

from crossover.protos.event_file import Event


@pytest.fixture(scope="module")
def bench():
    import bench.load_analysis as module

    return module


def test_split_deals_every_session_once_and_never_makes_an_empty_worker(bench):
    parts = bench.split(10, 4)
    assert parts == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert bench.split(3, 8) == [[0], [1], [2]]
    assert sorted(i for p in bench.split(64, 8) for i in p) == list(range(64))


def test_net_of_queueing_subtracts_the_daemons_queue_time_of_the_same_request(bench):
    client = {("a", 0): 0.150, ("a", 1): 0.010, ("b", 0): 0.020}
    daemon = {("a", 0): 0.149, ("a", 1): 0.0095, ("c", 0): 1.0}
    net, unmatched = bench.net_of_queueing(client, daemon)
    assert net == pytest.approx([0.001, 0.0005])
    assert unmatched == 1  # ("b", 0) has no grant record


def test_lost_requests_are_ungranted_requests_and_refusals_while_attached_counted_once(bench):
    requested = {("a", 0), ("a", 1), ("b", 0)}
    granted = {("a", 0), ("b", 0)}
    assert bench.lost_requests(requested, granted, {("a", 1), ("b", 3)}) == {("a", 1), ("b", 3)}


def test_grant_records_reads_requests_and_queue_times_from_the_event_log(bench):
    lines = [{"t": 1.0, "event": "register", "job": "a"},
             {"t": 2.0, "event": "request", "job": "a", "iteration": 0, "seq": 1},
             {"t": 3.0, "event": "grant", "job": "a", "iteration": 0, "waited_s": 0.25},
             {"t": 4.0, "event": "request", "job": "a", "iteration": 1, "seq": 2}]
    requested, granted = bench.grant_records([Event.from_json(x) for x in lines])
    assert requested == {("a", 0), ("a", 1)}
    assert granted == {("a", 0): 0.25}


def test_a_leak_is_suspected_only_when_the_last_wave_still_leaves_threads_in_proportion_to_its_sessions(bench):
    assert not bench.leak_suspected([17], 64)  # one wave: nothing to compare
    assert not bench.leak_suspected([15, 21, 21], 64)  # a pool that grew, then held
    assert not bench.leak_suspected([15, 17, 19], 64)  # still growing, but by far fewer than the sessions
    assert bench.leak_suspected([77, 141, 205], 64)  # a thread per session, every wave
    assert bench.leak_suspected([14, 15], 2)
