"""A rank's grant waits in bounded memory (`GrantWaits`): the first ones kept whole, every one in a histogram."""
from __future__ import annotations

import math
import random
import sys

from crossover.client.rank.grant_waits import GrantWaits


def test_a_long_run_keeps_bounded_memory_and_counts_every_wait() -> None:
    waits = GrantWaits()
    rnd = random.Random(3)
    samples = [rnd.lognormvariate(math.log(2e-4), 1.0) for _ in range(300_000)]
    for s in samples:
        waits.add(s)
    assert waits.count == len(waits) == 300_000
    assert waits.first == samples[:GrantWaits.KEEP]  # in order: a benchmark slices its warm-up off
    assert math.isclose(waits.total_s, sum(samples), rel_tol=1e-9)
    assert sys.getsizeof(waits.first) < 64 * 1024 and sum(waits.histogram().values()) == 300_000
    median = sorted(samples)[len(samples) // 2]
    assert median <= waits.quantile(0.5) <= median * 10 ** 0.25 * 1.0001  # within its bucket: a quarter decade


def test_the_histogram_has_an_underflow_and_an_overflow_bucket() -> None:
    waits = GrantWaits()
    for s in (0.0, 5e-7, 2e-6, 0.5, 5e3):
        waits.add(s)
    hist = waits.histogram()
    assert hist["1e-06"] == 2 and hist["inf"] == 1 and sum(hist.values()) == 5
    assert waits.quantile(1.0) == math.inf and GrantWaits().quantile(0.5) == 0.0


def test_waits_folded_in_a_batch_are_the_waits_added_one_by_one() -> None:
    one, many = GrantWaits(), GrantWaits()
    waits = [i * 1e-4 for i in range(5000)]
    for w in waits:
        one.add(w)
    many.add_many(waits[:1024])
    many.add_many(waits[1024:])
    assert (one.first, one.count, one.histogram()) == (many.first, many.count, many.histogram())
