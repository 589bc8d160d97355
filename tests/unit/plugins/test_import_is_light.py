"""`import crossover.auto` loads only what the script's framework needs, and nothing when disabled."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed import checkout_on_path

PROBE = """
import json, sys
import crossover.auto
loaded = {"after_import": sorted(m for m in ("torch", "horovod", "grpc") if m in sys.modules)}
import torch
import torch.nn.parallel
loaded["after_torch"] = sorted(m for m in ("horovod", "horovod.torch") if m in sys.modules)
loaded["ddp_hooked"] = hasattr(torch.nn.parallel.DistributedDataParallel.__init__, "__wrapped__")
print(json.dumps(loaded))
"""


def _probe(**env: str) -> dict:
    full = {**os.environ, "CROSSOVER_SOCKET": "/nonexistent/crossover.sock", **env}
    full["PYTHONPATH"] = checkout_on_path(full)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_a_disabled_import_loads_nothing_and_hooks_nothing():
    assert _probe(CROSSOVER_DISABLE="1") == {"after_import": [], "after_torch": [], "ddp_hooked": False}


@pytest.mark.timeout(150)
def test_a_ddp_script_loads_nothing_of_horovod():
    assert _probe() == {"after_import": [], "after_torch": [], "ddp_hooked": True}
