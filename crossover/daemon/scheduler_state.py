"""What the scheduler's parts share under its one lock: the node's sessions, leases and phase machine,
its clocks and event log, and the one way a decision is committed (logged, then sent).

The scheduler (`scheduler.Scheduler`: ranks' lifecycle) builds one and hands it to its parts,
`ownership.JobOwnership` (whose a job is, its class) and `steering.Steering` (the operator's calls),
so each part names what it depends on instead of reaching into a common base class.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from crossover.daemon.event_log import EventLog
from crossover.daemon.events import Decision
from crossover.daemon.inventory import Inventory
from crossover.daemon.leases import Leases
from crossover.daemon.messages import PreemptMsg
from crossover.daemon.phases import PhaseMachine
from crossover.daemon.registry import Registry
from crossover.protos.event_records import Isolation, Preempt

__all__ = ["SchedulerState"]


@dataclass(eq=False)
class SchedulerState:
    """The node's scheduling state. Every read or change of it holds `lock`, and reads `clock` under it:
    a thread preempted between reading the clock and taking the lock would log its decision before one
    it follows."""

    inventory: Inventory
    node: str
    events: EventLog
    sessions: Registry
    leases: Leases
    phases: PhaseMachine
    clock: Callable[[], float]
    wall: Callable[[], float]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False  # shutting down: no new rank, no event applied

    def commit(self, d: Decision, now: float) -> None:
        """Log the decision's entries, then send its messages; called with the lock held, so the
        log's order is the order decisions were made (tests and benchmarks check policies against it).
        Holders the policy now wants to yield to a higher class are asked to, in the same decision."""
        for key in self.phases.policy.take_preemptions():
            sess = self.sessions.by_key(key)
            if sess is not None and sess.accepts_preempt:
                d.log(sess, Preempt())
                d.post(sess, PreemptMsg())
        d.commit(self.events, self.node, now)
        for device, change in self.phases.policy.take_isolation_changes():  # dated the decision's instant
            self.events.record(Isolation(device=device, window=change.window.value, budget=change.budget,
                                         reference_s=change.reference_s, current_s=change.current_s,
                                         reason=change.reason), t=now)
