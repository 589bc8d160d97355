"""The emulated device's arithmetic (testbed.device_model.model) and its server, on a real Unix socket."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from testbed.device_model import DeviceModel, DeviceParams
from testbed.device_model.client import DeviceClient, DeviceGone

P = DeviceParams(slice_us=1000.0, switch_us=50.0, interference=0.25)


def test_alone_runs_at_full_speed() -> None:
    m = DeviceModel(P)
    m.submit("a", 0.1, now=0.0)
    assert m.next_finish() == pytest.approx(0.1)
    assert m.finished(0.0999) == []
    assert m.finished(0.1) == ["a"]
    assert m.next_finish() is None


def test_two_contexts_share_with_a_switch_cost() -> None:
    m = DeviceModel(P)
    m.submit("a", 0.1, now=0.0)
    m.submit("b", 0.1, now=0.0)
    # each at 1 / (2 * 1.05): both finish at 0.21
    assert m.next_finish() == pytest.approx(0.21)
    assert m.finished(0.21 + 1e-9) == ["a", "b"]
    assert m.shared_s == pytest.approx(0.21, rel=1e-6)


def test_late_arrival_slows_the_first_only_while_both_compute() -> None:
    m = DeviceModel(P)
    m.submit("a", 0.1, now=0.0)
    m.submit("b", 0.1, now=0.05)  # a has 0.05 left, now at 1/2.1
    t_a = 0.05 + 0.05 * 2.1
    assert m.next_finish() == pytest.approx(t_a)
    assert m.finished(t_a + 1e-9) == ["a"]
    # b did 0.05 * ... at 1/2.1 while a ran: 0.105/2.1 = 0.05 done, 0.05 left at full speed
    assert m.next_finish() == pytest.approx(t_a + 0.05)


def test_an_allreduce_beside_compute_slows_it() -> None:
    m = DeviceModel(P)
    m.set_comm("peer", True, now=0.0)
    m.submit("a", 0.1, now=0.0)
    assert m.next_finish() == pytest.approx(0.125)
    m.set_comm("peer", False, now=0.025)  # 0.02 done, 0.08 left at full speed
    assert m.next_finish() == pytest.approx(0.105)


def test_a_context_that_leaves_frees_the_device() -> None:
    m = DeviceModel(P)
    m.submit("a", 0.1, now=0.0)
    m.submit("b", 1.0, now=0.0)
    m.remove("b", now=0.021)  # a did 0.01
    assert m.next_finish() == pytest.approx(0.021 + 0.09)


def test_bad_input_is_refused() -> None:
    m = DeviceModel(P)
    m.submit("a", 0.1, now=0.0)
    with pytest.raises(ValueError, match="already computing"):
        m.submit("a", 0.1, now=0.0)
    with pytest.raises(ValueError, match="negative"):
        m.submit("b", -1.0, now=0.0)
    with pytest.raises(ValueError, match="shorter than the slice"):
        DeviceParams(slice_us=100.0, switch_us=100.0)


def test_rate_matches_the_simulators_processor_sharing() -> None:
    assert P.compute_rate(1, False) == 1.0
    assert P.compute_rate(3, False) == pytest.approx(1 / (3 * 1.05))
    assert P.compute_rate(3, True) == pytest.approx(1 / (3 * 1.05 * 1.25))
    assert P.compute_rate(0, True) == 0.0


def test_server_serves_two_contexts_on_a_real_socket(tmp_path) -> None:
    path = tmp_path / "dev.sock"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.device_model.server", "--socket", str(path),
                             "--slice-us", "1000", "--switch-us", "0", "--interference", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        a, b = DeviceClient(str(path)), DeviceClient(str(path))
        t0 = time.monotonic()
        a.compute(0.2)
        alone = time.monotonic() - t0
        b._send("compute 0.2\n")  # b starts; a's next phase now shares the device with it
        time.sleep(0.01)
        t0 = time.monotonic()
        a.compute(0.1)
        shared = time.monotonic() - t0
        assert 0.19 <= alone < 0.35
        assert shared >= 0.19  # half speed while b computes
        a.close()
        b.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert '"phases": 3' in out
    with pytest.raises(DeviceGone):
        DeviceClient(str(path))
