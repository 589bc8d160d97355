"""scikit-learn's bundled 8x8 digits (1,797 images, 64 pixels valued 0..16, ten classes), read from the
file scikit-learn ships without importing scikit-learn: its import (with SciPy) costs a rank about two
seconds of CPU, paid by every rank of every job the test tiers start."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["load_digits"]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images as float64 rows of 64 pixels, and their int64 labels: `sklearn.datasets.load_digits`'s
    `(X, y)`, the same values."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits come from scikit-learn's package data: pip install scikit-learn")
    table = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
                       delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)
