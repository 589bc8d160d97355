from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# Before anything imports gRPC: the tests fork+exec daemons and ranks while this process holds
# gRPC channels, and gRPC's fork handlers can deadlock inside fork() (grpc/grpc#37259).
# testbed.cluster sets the same default, but only if it is imported first.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from testbed.harness.daemon import DaemonProc  # noqa: E402
from testbed.harness.jobs import Job  # noqa: E402


@pytest.fixture
def daemon_factory(tmp_path):
    """Start real crossoverd processes on temp sockets; all are stopped at teardown."""
    started: list[DaemonProc] = []

    def make(*args: str, name: str = "d", socket: Path | None = None) -> DaemonProc:
        d = DaemonProc.in_dir(tmp_path, *args, name=name)
        if socket is not None:
            d.socket = socket
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.kill()


@pytest.fixture
def jobs():
    """Collects horovodrun jobs so teardown kills any still running."""
    running: list[Job] = []
    yield running
    for j in running:
        j.kill()


def pytest_collection_modifyitems(config, items):
    if shutil.which("horovodrun") is None and not (Path(sys.executable).parent / "horovodrun").exists():
        # `make test` sets CROSSOVER_TEST_STRICT=1: there, a missing Horovod is an error, never a skip.
        if os.environ.get("CROSSOVER_TEST_STRICT") == "1":
            raise pytest.UsageError("horovodrun is missing although CROSSOVER_TEST_STRICT=1")
        skip = pytest.mark.skip(reason="horovodrun not installed: run `make test`, which bootstraps it")
        for item in items:
            if "multiprocess" in item.keywords:
                item.add_marker(skip)
