"""bench.priority's arithmetic: what a low job can get at most beside a production job kept whole."""
from __future__ import annotations

import pytest

from bench.priority import low_ceiling


def test_a_low_jobs_ceiling_is_the_device_time_the_production_job_leaves_free():
    assert low_ceiling(0.150, 0.300) == pytest.approx(1.0)  # 1:1: half the device is free, a low job needs half
    assert low_ceiling(0.150, 0.300, lows=2) == pytest.approx(0.5)
    assert low_ceiling(0.150, 0.250, interference=0.19) == pytest.approx((0.4 / 0.6) / 1.19)
    assert low_ceiling(0.300, 0.300) == 0.0  # no gaps: only the guard serves a low job
    assert low_ceiling(0.0, 0.300) == 0.0


def test_a_low_job_on_one_node_needs_its_own_time_alone():
    # a one-rank low job has no allreduce: alone it keeps the device busy all the time, so the half of the
    # production job's device time that is free gives it half its speed, not all of it
    assert low_ceiling(0.150, 0.300, low_iter_s=0.150) == pytest.approx(0.5)
    assert low_ceiling(0.150, 0.300, low_iter_s=0.300) == low_ceiling(0.150, 0.300)
