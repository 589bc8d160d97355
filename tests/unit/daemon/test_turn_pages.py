"""The daemon's turn pages on their own: what a page owes, when the daemon stores it, and what it frees."""
from __future__ import annotations

import fcntl
import mmap
import os

import pytest

from crossover.daemon.handover import Pages
from crossover.protos.turn_page import PAGE_BYTES, reached


def _word(fd: int) -> int:
    return int.from_bytes(os.pread(fd, 4, 0), "little")


def test_a_page_owes_the_ticket_of_its_last_release_until_its_device_stores_it():
    pages = Pages()
    page = pages.open("s1")
    assert page.word == 0 and pages.rescue("s1") == 0  # nothing owed yet
    assert pages.released("s1", 3, now=10.0) is page and page.owed == 3
    assert pages.overdue(now=12.0, after_s=3.0) == []
    assert pages.overdue(now=13.5, after_s=3.0) == ["s1"]
    os.pwrite(page.fd, (3).to_bytes(4, "little"), 0)  # the rank's device stored it
    assert pages.overdue(now=20.0, after_s=3.0) == [] and pages.rescue("s1") == 0
    pages.close_all()


def test_the_daemon_stores_what_a_gone_rank_owed_and_frees_its_page():
    pages = Pages()
    page = pages.open("s1")
    keep = os.dup(page.ro_fd)  # a waiter's descriptor outlives the daemon's
    pages.released("s1", 5, now=1.0)
    assert pages.close("s1") == 5
    assert _word(keep) == 5 and pages.of("s1") is None
    with pytest.raises(OSError):
        os.fstat(page.fd)
    os.close(keep)


def test_once_sealed_nobody_maps_a_page_writable_again_but_the_daemon_still_stores():
    pages = Pages()
    page = pages.open("s1")
    assert os.fstat(page.fd).st_size == PAGE_BYTES
    assert pages.seal("s1") and not pages.seal("nobody")
    with pytest.raises(PermissionError):
        mmap.mmap(page.fd, PAGE_BYTES)
    assert fcntl.fcntl(page.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
    pages.released("s1", 2, now=0.0)
    assert pages.rescue("s1") == 2 and page.word == 2
    pages.close_all()


def test_a_word_far_ahead_of_its_ticket_has_not_reached_it_so_a_rank_cannot_hide_a_debt_that_way():
    assert reached(5, 5) and reached(6, 5) and reached(2, 0xFFFFFFFE)  # tickets wrap
    assert not reached(4, 5) and not reached(0xFFFFFFFF, 5) and not reached(0, 1)
    pages = Pages()
    page = pages.open("s1")
    pages.released("s1", 3, now=0.0)
    os.pwrite(page.fd, (0xFFFFFFFF).to_bytes(4, "little"), 0)  # the GPU's wait for 3 would never pass
    assert pages.overdue(now=10.0, after_s=3.0) == ["s1"] and pages.rescue("s1") == 3 and page.word == 3
    pages.close_all()
