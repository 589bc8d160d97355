"""The isolation controller with real jobs: a production and a low Horovod job on one device of a real crossoverd.

Read from the event log: the device first measures the production job alone (a solo window, in which the low
job gets no grant), then shares with a budget; the low job trains in the shared windows; each budget change is
an `isolation` event with its reason; `crossover queue` shows the controller.
"""
from __future__ import annotations

import json

import pytest

from crossover.protos.event_file import EventName
from crossover.protos.event_records import Isolation
from testbed.harness.daemon import cli
from testbed.harness.jobs import horovodrun, with_import
from testbed.harness.polling import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_the_low_job_waits_out_the_solo_windows_and_trains_within_its_budget(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover")
    script = with_import(tmp_path)
    args = ("--iters", "100000", "--width", "256", "--batch", "128")
    prod = horovodrun("prod", script, tmp_path, np=1, args=args, stoppable=True,
                      env={"CROSSOVER_SOCKET": str(d.socket)})
    jobs.append(prod)
    low = horovodrun("sweep", script, tmp_path, np=1, args=args, stoppable=True,
                     env={"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_PRIORITY": "low"})
    jobs.append(low)

    def shared_and_low_trained() -> bool:
        evs = d.events()
        shared = [e for e in evs if e.name is EventName.ISOLATION and Isolation.of(e).window == "shared"]
        return bool(shared) and sum(e.name is EventName.GRANT and e.job_name == "sweep"
                                    and e.t > shared[0].t for e in evs) >= 3

    wait_until(shared_and_low_trained, 90, "a shared window in which the low job trained")
    queue = json.loads(cli("queue", "--json", socket=d.socket).stdout)
    iso = queue["devices"][0].get("isolation")
    assert iso and iso["target"] == pytest.approx(0.97), queue
    for job in (prod, low):
        job.stop()

    evs = d.events()
    marks = [(e.t, Isolation.of(e)) for e in evs if e.name is EventName.ISOLATION]
    assert marks[0][1].window == "solo" and marks[0][1].reason, marks[0]
    first_shared = next(m for _t, m in marks if m.window == "shared")
    assert first_shared.reference_s and first_shared.reference_s > 0
    # No low grant inside a solo window: from each solo mark to the mark that ends it.
    for (begin_t, begin), (end_t, _end) in zip(marks, marks[1:]):
        if begin.window == "solo":
            inside = [e for e in evs if e.name is EventName.GRANT and e.job_name == "sweep"
                      and begin_t < e.t < end_t]
            assert not inside, f"the low job was granted in a solo window ({begin_t:.2f}-{end_t:.2f}): {inside[:3]}"
