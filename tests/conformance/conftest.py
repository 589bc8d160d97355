"""The conformance tier needs Horovod's own suite and examples beside the checkout (`../shared/peer/`).

Where they are not (a plain clone), the tests that run them are skipped with one reason
that says what they need; where `CI=true` (CI has the folder), they run and fail if it is
missing, so CI never passes them by skipping.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance.judge import PEER

_NEEDS_PEER = {"test_peer_examples.py", "test_horovod_suite.py", "test_peer_elastic.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PEER.exists() or os.environ.get("CI") == "true":
        return
    skip = pytest.mark.skip(reason=f"Horovod 0.28.1's own tests and examples are not at {PEER}: put the shared "
                                   "folder (its peer/ holds them) beside this checkout to run them; CI has it")
    for item in items:
        if Path(str(item.fspath)).name in _NEEDS_PEER:
            item.add_marker(skip)
