"""The fuzz tier's fixtures: the module's counts and a live daemon watched for escaped exceptions."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossover.daemon import session_stream
from crossover.daemon.api import CrossoverError
from tests.fuzz._fuzz_harness import Fuzzd, Problems, Stats
from tests.fuzz._fuzz_strategies import EXAMPLES

_log = logging.getLogger("tests.fuzz")


@pytest.fixture(scope="module")
def stats() -> Iterator[Stats]:
    """The module's counts: logged at INFO at the end, and written as JSON to $CROSSOVER_FUZZ_REPORT."""
    s = Stats()
    t0 = time.monotonic()
    yield s
    summary = {**s.as_dict(), "seconds": round(time.monotonic() - t0, 2), "examples_per_test": EXAMPLES}
    _log.info("fuzz summary: %s", json.dumps(summary, sort_keys=True))
    if path := os.environ.get("CROSSOVER_FUZZ_REPORT"):
        Path(path).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


@pytest.fixture
def fuzzd(stats: Stats, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fuzzd]:
    """A started daemon, watched for escaped exceptions; stopped at teardown."""
    problems = Problems()
    root = logging.getLogger()
    root.addHandler(problems)
    monkeypatch.setattr(threading, "excepthook", problems.thread_died)
    real_apply = session_stream.apply_event

    def apply_event(*args: Any, **kwargs: Any) -> Any:  # same call, watched: the gRPC stream swallows the rest
        try:
            return real_apply(*args, **kwargs)
        except CrossoverError:
            raise
        except Exception as exc:
            problems.found.append(f"apply_event raised {exc!r} on {str(args[2])[:300]}")
            raise

    monkeypatch.setattr(session_stream, "apply_event", apply_event)
    with tempfile.TemporaryDirectory(prefix="xofz-") as tmp:
        h = Fuzzd(Path(tmp) / "d.sock", stats, problems)
        try:
            yield h
        finally:
            h.close()
            root.removeHandler(problems)
