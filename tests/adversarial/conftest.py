"""Fixtures of the adversarial tier (its helpers are in `attack_bed`)."""
from __future__ import annotations

import os

import pytest
from attack_bed import remove, shared_folder


@pytest.fixture
def base():
    """A folder a second local user may traverse. Where the tests cannot act as one (not root) they skip, except
    under `make test` (CROSSOVER_TEST_STRICT=1), where nothing may skip: there it is an error."""
    if os.geteuid() != 0:
        if os.environ.get("CROSSOVER_TEST_STRICT") == "1":
            pytest.fail("the adversarial tier acts as a second user and needs root (setuid); CROSSOVER_TEST_STRICT=1 "
                        "forbids skipping it: run `make test` as root, or the tier alone without the strict flag")
        pytest.skip("acting as a second user needs root (setuid)")
    folder = shared_folder()
    yield folder
    remove(folder)
