"""bench.shared_device's arithmetic: the middle-half rate and the per-cycle ratios to unscheduled."""
from __future__ import annotations

import pytest

from bench.shared_device import main, middle_rate, summarise


def test_middle_rate_leaves_out_the_first_and_last_quarter():
    times = [1.0] * 4 + [0.01] * 8 + [1.0] * 4  # slow start-up and shutdown
    assert middle_rate(times) == pytest.approx(100.0)
    assert middle_rate([]) == 0.0


def test_each_mode_is_judged_against_unscheduled_of_its_own_cycle():
    runs = [{"cycle": c, "layout": "together", "mode": m, "sum": s}
            for c, m, s in [(0, "unscheduled", 100.0), (0, "crossover", 80.0), (0, "adaptive", 99.0),
                            (1, "unscheduled", 50.0), (1, "crossover", 45.0), (1, "adaptive", 51.0)]]
    rows = summarise(runs)["together"]
    assert rows["crossover"]["vs_unscheduled"] == pytest.approx([0.8, 0.9])
    assert rows["adaptive"]["median_vs_unscheduled"] == pytest.approx((0.99 + 1.02) / 2)
    assert summarise(runs)["alone"]["adaptive"]["vs_unscheduled"] == []


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit) as exc:
        main(["--cycles", "0"])
    assert exc.value.code == 2
