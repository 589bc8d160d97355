"""Rank 0's keeper of the parameter service (`ServiceProcess`): a real service process, started and stopped."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from crossover.plugins.aggregation.group_async.link import ServiceError
from crossover.plugins.aggregation.group_async.service_process import ServiceProcess

pytestmark = pytest.mark.timeout(120)


def test_the_service_imports_without_torch():
    # Importing torch took 8.7 s of a loaded 2-core machine, and 8 ranks' first boundary waited 20-30 s for the
    # service to start (one start in three runs timed out): the service needs numpy only.
    probe = "import sys, crossover.plugins.aggregation.group_async.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_service_starts_serves_and_leaves_nothing_behind():
    service = ServiceProcess("127.0.0.1", bound=2)
    host, port = service.start()
    try:
        with socket.create_connection((host, port), timeout=5):
            pass
    finally:
        service.stop()
    assert service.proc is not None and service.proc.returncode is not None
    assert not Path(service.state_dir).exists() and not service._dir.exists()  # noqa: SLF001 - its own folder


def test_a_service_that_cannot_start_says_why_though_its_log_goes_with_the_job():
    service = ServiceProcess("127.0.0.1", bound=2, schedule="sometimes")
    try:
        with pytest.raises(ServiceError, match=r"exited with 2; its log ends: .*invalid choice: 'sometimes'"):
            service.start()
    finally:
        service.stop()
