"""A rank's side of the hand-over on the device, with a recording device: readiness, fallbacks, tickets;
and the CUDA device's calls, with a recording driver (the real one needs a GPU: bench.gpu --only handover)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from crossover.client.rank.device_turns import TurnHandover
from crossover.plugins.hook.cuda_turns import CudaTurns, CudaUnavailable, StreamMemory


class Device:
    name = "recording device"

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def _call(self, *call: object) -> None:
        if call[0] == self.fail:
            raise OSError(f"{call[0]} refused")
        self.calls.append(call)

    def attach_own(self, fd: int) -> None:
        self._call("own", fd)

    def attach_peer(self, page: int, fd: int) -> None:
        self._call("peer", page)

    def wait(self, page: int, ticket: int) -> None:
        self._call("wait", page, ticket)

    def signal(self, ticket: int) -> None:
        self._call("signal", ticket)

    def drain(self) -> None:
        self._call("drain")


def _page() -> int:
    fd = os.memfd_create("turn-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    return fd


def _ready(device: Device) -> TurnHandover:
    turns = TurnHandover()
    turns.page(1, True, _page())
    assert turns.use(device) and turns.ready
    return turns


@pytest.mark.parametrize("device_first", [True, False])
def test_a_rank_is_ready_once_it_has_both_its_page_and_a_device_in_either_order(device_first):
    turns, device = TurnHandover(), Device()
    if device_first:
        assert turns.use(device) is False and not turns.ready
        turns.page(1, True, _page())  # on the receiving thread: nothing touches the device there
        assert device.calls == [] and not turns.ready
        assert turns.attach_pending() is True  # the training thread's next acquire maps it
    else:
        turns.page(1, True, _page())
        assert turns.use(device) is True
    assert turns.ready and [c[0] for c in device.calls] == ["own"] and turns.attach_pending() is False
    assert turns.end_turn() == 1 and turns.end_turn() == 2
    turns.close()
    assert not turns.ready and turns.end_turn() == 0


def test_a_peer_page_is_mapped_once_and_each_grant_waits_on_it():
    device = Device()
    turns = _ready(device)
    turns.page(7, False, _page())
    turns.wait_after(7, 3)
    turns.wait_after(7, 4)
    turns.wait_after(9, 1)  # never sent: nothing to wait on, one warning
    assert device.calls[1:] == [("peer", 7), ("wait", 7, 3), ("wait", 7, 4)]


def test_a_rank_that_cannot_hand_over_still_waits_for_a_named_page_on_its_cpu():
    turns = TurnHandover()  # no device at all: a grant that names a page still orders its work
    peer = _page()
    turns.page(7, False, os.open(f"/proc/self/fd/{peer}", os.O_RDONLY))
    os.pwrite(peer, (0xFFFFFFF0).to_bytes(4, "little"), 0)  # far ahead is behind: the comparison wraps
    turns.cpu_wait_limit_s = 0.2
    start = time.monotonic()
    turns.wait_after(7, 5)
    assert time.monotonic() - start >= 0.19  # it waited (then gave up: nobody will store it)
    os.pwrite(peer, (5).to_bytes(4, "little"), 0)
    turns.cpu_wait_limit_s = 10.0  # waiting now would take this long: the bound below is only a hang guard
    start = time.monotonic()
    turns.wait_after(7, 5)
    assert time.monotonic() - start < 5.0
    os.close(peer)


def test_a_device_that_cannot_wait_leaves_the_wait_to_the_cpu_and_the_order_holds():
    turns = _ready(Device(fail="wait"))
    peer = _page()
    turns.page(7, False, os.open(f"/proc/self/fd/{peer}", os.O_RDONLY))
    released = threading.Timer(0.1, lambda: os.pwrite(peer, (5).to_bytes(4, "little"), 0))
    start = time.monotonic()
    released.start()
    turns.wait_after(7, 5)
    assert time.monotonic() - start >= 0.09
    released.join()
    os.close(peer)


def test_a_device_that_cannot_end_a_turn_sends_the_rank_back_to_its_cpu():
    turns = _ready(Device(fail="signal"))
    assert turns.end_turn() == 0 and not turns.ready


def test_the_driver_binds_or_says_why_not_in_one_error():
    try:
        StreamMemory()
    except CudaUnavailable as exc:  # this CPU machine: no libcuda.so.1
        assert "CUDA driver" in str(exc)


class Driver:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register_host(self, host_addr: int, size: int, read_only: bool = False) -> int:
        assert host_addr and size == 4096
        self.calls.append(("register", read_only))
        return 0x1000 * (len(self.calls))

    def wait_value(self, stream: int, device_addr: int, value: int) -> None:
        self.calls.append(("wait", stream, device_addr, value))

    def write_value(self, stream: int, device_addr: int, value: int) -> None:
        self.calls.append(("write", stream, device_addr, value))


def test_cuda_turns_register_the_own_page_writable_and_peers_read_only_and_use_the_current_stream():
    driver = Driver()
    turns = CudaTurns(lambda: 42, lambda: None, memory=driver)  # type: ignore[arg-type]
    own, peer = _page(), _page()
    turns.attach_own(own)
    turns.attach_peer(3, os.open(f"/proc/self/fd/{peer}", os.O_RDONLY))
    turns.wait(3, 9)
    turns.signal(10)
    assert driver.calls == [("register", False), ("register", True), ("wait", 42, 0x2000, 9),
                            ("write", 42, 0x1000, 10)]
    with pytest.raises(OSError):  # a read-only descriptor cannot become a writable own page
        turns.attach_own(os.open(f"/proc/self/fd/{peer}", os.O_RDONLY))


def test_a_page_whose_descriptor_did_not_come_is_left_out_with_a_warning(caplog):
    turns = TurnHandover()
    turns.page(1, True, None)
    assert turns.use(Device()) is False and not turns.ready
    assert "sent turn page 1 without its descriptor" in caplog.text
