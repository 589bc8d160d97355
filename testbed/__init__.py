"""What the repository uses around the product, never installed with it: the emulated cluster,
the simulator, fault injection, the harness that starts real daemons and jobs for tests,
benchmarks and the demo, and the workloads they share."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def checkout_on_path(env: Mapping[str, str]) -> str:
    """`env`'s PYTHONPATH with the checkout first: a child that imports `testbed` (never installed) needs it."""
    return os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
