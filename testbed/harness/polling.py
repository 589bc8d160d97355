"""One way for a test to wait for something another process does: poll, then fail naming what never came."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float = 5.0, what: str = "the condition", interval: float = 0.05,
               give_up: Callable[[], str | None] | None = None) -> T:
    """Call `check` until it returns something true and return that.

    `AssertionError` naming `what` after `timeout` seconds, or as soon as `give_up` returns a reason
    (the process that was to do it has exited, say); the reason is in the message."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        reason = give_up() if give_up is not None else None
        if reason:
            raise AssertionError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
