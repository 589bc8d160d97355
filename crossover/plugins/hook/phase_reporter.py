"""One rank's phases as the daemon sees them: whether it holds its device, and its iteration.

Every optimizer a script builds reports to the same `PhaseReporter`, and so
does the hook on Horovod's waits (`crossover.plugins.hook.horovod_waits`): a GAN's
two optimizers, a metric allreduce and the optimizer's own allreduce all move
one state, and the reporter tells the session (`crossover.client.rank.session`)
each transition.

The rule that keeps co-located jobs from waiting on each other in a cycle: a
rank never holds its device while it waits for other ranks. Before any
Horovod wait that may block, a holder hands the device back (a *yield*); when
the wait ends it asks again with the same iteration, so its place in the
rotation does not change, and goes on with its compute phase.

Pure: time comes from an injected clock, and the wait for a device's queued
work before a release is an injected ``settle`` callback (the plugin passes a
CUDA event wait for GPU parameters), so the state machine runs in tests
without a daemon, Horovod or torch. So is ``pace``, which an outranked
holder calls at every layer boundary to keep little work queued ahead of its
device: a yield hands the device over only once that work is done. Where the session hands over on the
device (`crossover.client.rank.device_turns`) a release queues its ticket on the
device instead of settling.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Protocol

from crossover.client.rank.device_memory import OverMemoryCap

__all__ = ["PhaseReporter", "PhaseSession"]

_log = logging.getLogger(__name__)


class PhaseSession(Protocol):
    """What `PhaseReporter` needs of a session (`crossover.client.rank.session.Session` is one)."""

    @property
    def shares_device(self) -> bool: ...

    def acquire(self, iteration: int, comm_s: float | None = None) -> bool: ...

    def release(self, iteration: int, duration_s: float = 0.0, comm_begins: bool = False,
                yields: bool = False, ticket: int = 0) -> None: ...

    def comm_begin(self, iteration: int) -> None: ...

    def take_preempted(self) -> bool: ...

    @property
    def outranked(self) -> bool: ...  # a rank of a higher class shares the device and may ask for it

    preempted: bool  # a higher-class rank asked for the device since the last `take_preempted`

    @property
    def hands_over(self) -> bool: ...

    def end_turn(self) -> int: ...


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Never let a scheduling hook break training: log the error and carry on unscheduled."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OverMemoryCap:  # the rank holds memory a higher class reserved: the one error training sees
            raise
        except Exception:
            _log.exception("crossover phase hook failed; continuing unscheduled")
            return None

    return wrapper


class PhaseReporter:
    """The rank's phase state. Transitions take a lock: a GPU's backward runs hooks on autograd's thread.

    ``iteration`` is the rank's iteration number as the daemon sees it: it
    advances when an allreduce ends (:meth:`comm_end`), whichever optimizer
    made it. ``settle``, when set, runs before every release and returns once
    the device has finished the work queued on it (so the released time is
    the device's, not the launch queue's).
    """

    def __init__(self, session: PhaseSession, settle: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, pace: Callable[[], None] | None = None) -> None:
        self.session = session
        self._memory = getattr(session, "memory", None)  # its memory caps (`Session.memory`); None: a bare session
        self.settle = settle
        self.pace = pace
        self.forward_hook: Any = None  # the handle of a forward pre-hook that calls `at_boundary`, if one is set
        self._clock = clock
        self._lock = threading.RLock()
        self.iteration = 0
        self.holding = False
        self.in_comm = False  # the daemon has been told this iteration's allreduce began
        self.yielded = False  # the device was handed back mid-phase and is owed a resume
        self.yields = 0  # how many times this rank handed its device back to wait for peers
        self._since = 0.0  # when the device was last granted (its compute time since then)
        self.on_phase_start: list[Callable[[], None]] = []  # per-optimizer counters reset here

    # ---- the optimizer's phase points ----------------------------------

    @guarded
    def ensure_holding(self) -> None:
        """The rank is about to use its device (zero_grad, the update): ask for it if not held; a memory cap
        the daemon sent since is applied first (`device_memory`)."""
        memory = self._memory
        if memory is not None and (memory.pending or memory.limit is not None):
            memory.at_phase_point()
        with self._lock:
            if self.yielded:
                self._resume()
            elif not self.holding:
                self._acquire()

    @guarded
    def compute_done(self) -> None:
        """The iteration's gradients are all submitted: release the device, the allreduce begins."""
        with self._lock:
            if self.holding:
                self._release(comm_begins=True)

    @guarded
    def comm_begin(self) -> None:
        """The rank waits for its allreduce: a holder releases, others say the allreduce began."""
        with self._lock:
            self.yielded = False
            if self.holding:
                self._release(comm_begins=True)
            elif not self.in_comm:
                self.session.comm_begin(self.iteration)
                self.in_comm = True

    @guarded
    def comm_end(self, duration_s: float) -> None:
        """The allreduce ended: the next iteration's compute phase asks for the device."""
        with self._lock:
            self.iteration += 1
            self._acquire(comm_s=duration_s)

    # ---- waits for other ranks -----------------------------------------

    @contextlib.contextmanager
    def waiting_for_peers(self) -> Iterator[None]:
        """Around a wait that may block on other ranks: the device is free during it."""
        paused = self.pause()
        try:
            yield
        finally:
            if paused:
                self.resume()

    @guarded
    def pause(self) -> bool:
        """Hand the device back if held (True then: `resume` must follow)."""
        with self._lock:
            if not self.holding:
                return False
            self._release(comm_begins=False, yields=True)
            self.yielded = True
            self.yields += 1
            return True

    @guarded
    def at_boundary(self) -> None:
        """At a layer boundary (a gradient, a module's forward): an outranked holder first waits until at
        most a layer or two of its work is queued ahead of its device (``pace``); then it yields if asked.
        A GPU's CPU otherwise queues a whole forward and backward long before they run, and a yield
        would leave the higher-class rank waiting for all of it."""
        if self.pace is not None and self.holding and self.session.outranked:
            self.pace()
        self.yield_if_asked()

    @guarded
    def yield_if_asked(self) -> None:
        """At a gradient: if a higher-class rank asked for the device, hand it back and ask again at once
        (the daemon serves the higher rank first), so it waits at most about one layer's backward."""
        if self.session.take_preempted():
            with self._lock:
                if self.pause():
                    self.resume()

    @guarded
    def resume(self) -> None:
        """Take the device again after a pause, with the same iteration."""
        with self._lock:
            if self.yielded:
                self._resume()

    # ---- internals -----------------------------------------------------

    def _acquire(self, comm_s: float | None = None) -> None:
        for reset in self.on_phase_start:
            reset()
        self.in_comm = False
        self._resume(comm_s)

    def _resume(self, comm_s: float | None = None) -> None:
        """Ask for the device for this iteration (again, after a pause) and hold it."""
        self.yielded = False
        self.session.acquire(self.iteration, comm_s)
        self.holding = True
        self._since = self._clock()

    def _release(self, comm_begins: bool, yields: bool = False) -> None:
        ticket = self.session.end_turn() if self.session.hands_over else 0  # the device ends it (`device_turns`)
        if not ticket and self.settle is not None:
            self.settle()
        self.holding = False
        self.in_comm = comm_begins  # the gradients' allreduces are submitted: one message says both
        self.session.release(self.iteration, self._clock() - self._since, comm_begins=comm_begins, yields=yields,
                             ticket=ticket)
