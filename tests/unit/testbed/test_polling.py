"""testbed.harness.polling.wait_until: returns what the check found, or fails naming what never came and why."""
import pytest

from testbed.harness.polling import wait_until


def test_returns_the_first_true_value_the_check_gives():
    values = iter([0, None, [], "found"])
    assert wait_until(lambda: next(values), 5, interval=0) == "found"


def test_times_out_naming_what_it_waited_for():
    with pytest.raises(AssertionError, match=r"timed out after 0.05s waiting for the grant"):
        wait_until(lambda: False, 0.05, "the grant", interval=0.01)


def test_gives_up_at_once_with_the_reason():
    calls = []
    with pytest.raises(AssertionError, match="gave up waiting for training: the job exited 1"):
        wait_until(lambda: calls.append(1), 60, "training", give_up=lambda: "the job exited 1")
    assert calls == [1]
