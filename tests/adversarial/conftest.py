"""Fixtures of the adversarial tier (its helpers are in `attack_bed`)."""
from __future__ import annotations

import os

import pytest
from attack_bed import remove, shared_folder


@pytest.fixture
def base():
    """A folder a second local user may traverse; skips where the tests cannot act as one (not root)."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user needs root (setuid)")
    folder = shared_folder()
    yield folder
    remove(folder)
