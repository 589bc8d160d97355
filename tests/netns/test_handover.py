"""The hand-over on the device with real jobs: two 2-rank `horovodrun` jobs share each node's emulated device
under the crossover policy, end their turns on the device, and a holder SIGKILLed while its device still owes
its ticket does not hold the other job back. Needs root, `ip` and `tc` (as `test_cluster.py`)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from crossover.protos.event_records import Grant, HandoverRescue, Register
from testbed.cluster import Link
from testbed.device_model import DeviceParams
from testbed.harness.jobs import WORKLOADS, with_import
from tests.integration.rpc._world import wait_for
from tests.netns.test_cluster import _REASONS, cluster_factory  # noqa: F401 (the fixture)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(bool(_REASONS), reason="emulated cluster unavailable: " + "; ".join(_REASONS)),
]


@pytest.mark.timeout(240)
def test_jobs_hand_over_on_the_device_and_a_killed_holder_strands_nobody(cluster_factory, tmp_path):  # noqa: F811
    c = cluster_factory(nodes=2, link=Link(rate_mbit=400), policy="crossover",
                        device_model=DeviceParams(slice_us=1000, switch_us=40, interference=0.0))
    script = with_import(tmp_path, WORKLOADS / "train_bench.py")
    args = ["--iters", "100000", "--width", "128", "--batch", "200", "--queue-device-work",
            "--stop-file", str(tmp_path / "stop")]
    # doomed's turns keep its device busy for a second after it releases (200 samples x 5 ms), so the
    # kill below lands while its device still owes the ticket, however long reading the log took
    c.run([sys.executable, str(script), *args, "--device-ms-per-sample", "5.0", "--out", str(tmp_path / "doomed")],
          name="doomed")
    steady = c.run([sys.executable, str(script), *args, "--device-ms-per-sample", "1.0",
                    "--out", str(tmp_path / "steady")], name="steady")
    try:
        # Both jobs' ranks end their turns on the device, and grants name the ticket to wait for.
        wait_for(lambda: sum(e.name == "handover" for e in c.events(0)) >= 2, 90, 0.2)
        wait_for(lambda: any(e.name is Grant.name and Grant.of(e).after for e in c.events(0)), 30, 0.2)
        pid = next(Register.of(e).pid for e in c.events(0) if e.name is Register.name and e.job_name == "doomed")

        def owing() -> bool:  # doomed's rank on node 0 released a turn whose work its device is still doing
            mine = [e for e in c.events(0) if e.job_name == "doomed" and e.name in ("grant", "release")]
            return bool(mine) and mine[-1].name == "release"

        wait_for(owing, 30)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rescue = wait_for(lambda: [e for e in c.events(0) if e.name == "handover_rescue"], 10)
        assert rescue[0].job_name == "doomed" and HandoverRescue.of(rescue[0]).ticket >= 1
        def steady_grants() -> int:
            return sum(e.name == "grant" and e.job_name == "steady" for e in c.events(0))

        before = steady_grants()
        wait_for(lambda: steady_grants() >= before + 5, 20, 0.2)
        assert time.monotonic() - killed_at < 30
        assert steady.poll() is None, steady.output()[-3000:]
    finally:
        (tmp_path / "stop").touch()  # the cluster's teardown stops what is left of both jobs
