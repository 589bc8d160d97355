"""The emulated device's streams: work, syncs, page waits and signals (testbed.device_model), served in a thread.

A context's ops run in order; `wait` holds its stream until a shared page's word
reaches a ticket, `signal` stores one into the context's own page: a hand-over
of the device from one rank to the next without the host in between.
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crossover.client.rank.device_turns import DeviceTurns
from testbed.device_model import DeviceParams
from testbed.device_model.client import DeviceClient, DeviceGone
from testbed.device_model.server import DeviceServer
from testbed.device_model.turns import ModelTurns

PARAMS = DeviceParams(slice_us=1000.0, switch_us=0.0, interference=0.0)


class Bed:
    """A `DeviceServer` serving in a thread, and the clients and pages a test opened: all closed at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = DeviceServer(path, PARAMS)
        self.thread = threading.Thread(target=self.server.serve, name="device-server", daemon=True)
        self.thread.start()
        self.clients: list[DeviceClient] = []
        self.fds: list[int] = []

    def connect(self) -> DeviceClient:
        client = DeviceClient(str(self.path), timeout_s=5.0)
        self.clients.append(client)
        return client

    def page(self, name: str = "dm-page") -> int:
        """A fresh 4096-byte memfd page, its word 0."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.ftruncate(fd, 4096)
        return fd

    def read_only(self, fd: int) -> int:
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.fds.append(ro)
        return ro

    def stop(self) -> None:
        """Stop the server (a connection wakes its select at once) and close it: idempotent."""
        if self.thread.is_alive():
            self.server.stopping = True
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect(str(self.path))
            self.thread.join(5)
        self.server.close()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        try:
            self.stop()
        finally:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        assert not self.thread.is_alive(), "the device server did not stop"


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Bed]:
    b = Bed(tmp_path / "dev.sock")
    try:
        yield b
    finally:
        b.close()


def word(fd: int) -> int:
    value: int = struct.unpack("<I", os.pread(fd, 4, 0))[0]
    return value


def store(fd: int, value: int) -> None:
    os.pwrite(fd, struct.pack("<I", value), 0)


def until(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def open_to(name: str) -> int:
    """How many fds of this process (the server's included) are open on memfd `name`."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{entry}").startswith(f"/memfd:{name} ")
    return count


def test_submit_then_sync_returns_after_the_work(bed: Bed) -> None:
    c = bed.connect()
    t0 = time.monotonic()
    c.submit(0.05)
    c.submit(0.02)
    c.sync()
    elapsed = time.monotonic() - t0
    assert 0.07 <= elapsed < 0.5
    c.compute(0.01)  # the old blocking form still works on the same stream
    assert bed.server.phases == 3


def test_a_signal_hands_the_device_to_the_waiter(bed: Bed) -> None:
    a, b = bed.connect(), bed.connect()
    own = bed.page()
    a.attach_page(own, None)
    b.attach_page(bed.read_only(own), 7)
    t0 = time.monotonic()
    a.submit(0.05)
    a.signal(1)
    b.wait(7, 1)
    b.submit(0.05)
    a.sync()
    a_done = time.monotonic() - t0
    b.sync()
    b_done = time.monotonic() - t0
    assert a_done < 0.09  # a ran alone at full speed: b's work did not share the device beside it
    assert b_done >= 0.099  # b's work started when a's finished
    assert word(own) == 1


def test_model_turns_forward_to_the_client(bed: Bed) -> None:
    a, b = ModelTurns(bed.connect()), ModelTurns(bed.connect())
    turns: DeviceTurns = a
    assert turns.name == "device model"
    pa, pb = bed.page(), bed.page()
    a.attach_own(pa)
    b.attach_own(pb)
    a.attach_peer(2, bed.read_only(pb))
    b.attach_peer(1, bed.read_only(pa))
    a.client.submit(0.02)
    a.signal(1)
    b.wait(1, 1)
    b.client.submit(0.02)
    b.signal(1)
    a.wait(2, 1)
    a.signal(2)
    t0 = time.monotonic()
    a.drain()
    assert time.monotonic() - t0 >= 0.035  # a's signal 2 came after b's work, which came after a's
    b.drain()
    assert (word(pa), word(pb)) == (2, 1)
    os.fstat(pa)  # the caller's fds stay open


def test_an_outside_store_releases_a_waiter(bed: Bed) -> None:
    c = bed.connect()
    fd = bed.page()
    store(fd, 4)
    c.attach_page(fd, 3)
    c.wait(3, 5)
    timer = threading.Timer(0.05, store, (fd, 5))
    t0 = time.monotonic()
    timer.start()
    try:
        c.sync()
    finally:
        timer.cancel()
        timer.join()
    assert time.monotonic() - t0 >= 0.045
    store(fd, 0xFFFF_FFFF)
    c.wait(3, 0x8000_0000)  # unsigned: 0xFFFFFFFF >= 2**31
    c.sync()


def _send_raw(c: DeviceClient, line: bytes, fds: list[int]) -> None:
    socket.send_fds(c._sock, [line], fds)


@pytest.mark.parametrize("bad", ["wait on an unknown id", "page own without an fd", "signal without an own page",
                                 "page with two fds", "an fd on another line", "a page too short"])
def test_bad_input_drops_only_that_context(bed: Bed, bad: str) -> None:
    good = bed.connect()
    good.compute(0.001)
    c = bed.connect()
    fd = bed.page()
    if bad == "wait on an unknown id":
        c.wait(9, 1)
    elif bad == "page own without an fd":
        c._send("page own\n")
    elif bad == "signal without an own page":
        c.signal(1)
    elif bad == "page with two fds":
        _send_raw(c, b"page own\n", [fd, bed.page()])
    elif bad == "an fd on another line":
        _send_raw(c, b"comm 0\n", [fd])
    else:
        os.ftruncate(fd, 100)
        c.attach_page(fd, None)
    with pytest.raises(DeviceGone):
        c.sync()
    until(lambda: len(bed.server.contexts) == 1)
    good.compute(0.001)
    assert bed.thread.is_alive()


def test_closing_a_context_closes_its_fds_and_pages(bed: Bed) -> None:
    c = bed.connect()
    name = "dm-close-test"
    own, peer, spare = bed.page(name), bed.page(name), bed.page(name)
    c.attach_page(own, None)
    c.attach_page(peer, 4)
    c.sync()
    (ctx,) = bed.server.contexts
    first_peer = ctx.peers[4]
    c.attach_page(peer, 4)  # replacing an id unmaps the old page
    c.sync()
    assert first_peer.closed
    pages = [ctx.own, ctx.peers[4]]
    _send_raw(c, b"page 5", [spare])  # an fd still waiting for the end of its line
    until(lambda: len(ctx.fds) == 1)
    assert open_to(name) == 3 + 3  # the test's three, the server's two pages and the waiting fd
    c.close()
    # The server marks the context closed before it releases what it held, on its own thread: wait for the end.
    until(lambda: ctx.closed and not ctx.fds and ctx.own is None and not ctx.peers and open_to(name) == 3
          and all(p is not None and p.closed for p in pages))


def test_closing_the_server_closes_the_contexts_pages(bed: Bed) -> None:
    c = bed.connect()
    c.attach_page(bed.page(), None)
    c.sync()
    (ctx,) = bed.server.contexts
    page = ctx.own
    bed.stop()
    assert page is not None and page.closed and ctx.closed
    with pytest.raises(DeviceGone):
        c.sync()
