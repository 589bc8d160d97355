"""The test bed's digits are scikit-learn's, read from its package data without importing it."""
from __future__ import annotations

import numpy as np

from testbed.workloads.digits import load_digits


def test_the_digits_are_scikit_learns_own():
    from sklearn.datasets import load_digits as sklearn_digits

    x, y = load_digits()
    want_x, want_y = sklearn_digits(return_X_y=True)
    assert x.shape == (1797, 64) and x.dtype == want_x.dtype and y.dtype == np.int64
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
