"""The daemon's core: applies the policy's decisions to the node's rank sessions under one lock.

The policy decides; the scheduler acts. It registers ranks (`registry`),
applies their events (`phases`), leases devices to ranks alone on them
(`leases`), suspends and evicts silent or dead ranks (`liveness`), and
delivers each decision's messages (`messages`) once its entries are in the
event log (`events`). It knows nothing of gRPC: `server.py` translates.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Callable

import psutil

from crossover.daemon import policies
from crossover.daemon.api import AlreadyExists, FailedPrecondition, Phase, RankKey, RankRef, ResourceExhausted
from crossover.daemon.class_rules import ClassRules
from crossover.daemon.event_log import EventLog
from crossover.daemon.events import Decision, EventKind, RankEvent, record_rank
from crossover.daemon.grant_payoff import PayoffSettings
from crossover.daemon.handover import Pages, PagesUnavailable
from crossover.daemon.inventory import Inventory
from crossover.daemon.leases import Leases
from crossover.daemon.limits import StreamLimits
from crossover.daemon.liveness import Liveness, LivenessSettings
from crossover.daemon.messages import CloseMsg, GrantMsg, Message, PageMsg
from crossover.daemon.ownership import JobOwnership
from crossover.daemon.phases import PhaseMachine
from crossover.daemon.policies.classes import ClassSettings, Priority
from crossover.daemon.policies.memory import MemoryRules, caps
from crossover.daemon.registry import Registration, Registry, Session, printable_identity, validate_identity
from crossover.daemon.scheduler_state import SchedulerState
from crossover.daemon.steering import Steering
from crossover.protos.event_records import HandoverRescue, Leave, Register, Release
from crossover.protos.identity import RankIdentity

__all__ = ["Scheduler", "SchedulerSettings"]

_log = logging.getLogger(__name__)


def _process(pid: int) -> psutil.Process | None:
    """The process `pid` names, for its CPU and memory figures; None when this daemon cannot see it.

    Its CPU counter is read once here: psutil measures CPU use between two reads, so the
    first `crossover queue` then shows the rank's use since it registered, not 0.
    """
    if pid <= 0:
        return None
    try:
        process = psutil.Process(pid)
        process.cpu_percent(None)
        return process
    except (psutil.Error, ValueError):
        return None


@dataclass(frozen=True)
class SchedulerSettings:
    """How a node schedules, written once: `crossoverd`'s flags build one (their defaults are these: the
    crossover policy, adapt, leases and the hand-over on), and the tests and test beds build their own.

    `policy`: the policy's name (`policies.available()`); `node`: the name this node reports (empty: the
    host's); `heartbeat_interval_s`: how often ranks send a heartbeat; `lease`: lease a device to the ranks
    of a job alone on it; `max_sessions`: registered ranks at once (each registration costs every session
    on its device a share update, so a flood of them is bounded: twice the streams a daemon serves);
    `adapt`: measure per device whether grants pay (`payoff` says how); `class_rules`: the class a rank of
    each user or group gets; `classes`: the class rules' settings (guard share, isolation target);
    `handover`: ranks that can end their turns on their device do; `memory`: the memory reservations by
    class (`crossoverd --reserve`)."""

    policy: str = "crossover"
    node: str = ""
    heartbeat_interval_s: float = 0.2
    liveness: LivenessSettings = LivenessSettings()
    lease: bool = True
    max_sessions: int = 2 * StreamLimits.max_connections
    adapt: bool = True
    payoff: PayoffSettings = PayoffSettings()
    class_rules: ClassRules = ClassRules()
    classes: ClassSettings = ClassSettings()
    handover: bool = True
    memory: MemoryRules = MemoryRules()


class Scheduler:
    """Thread-safe registry plus policy executor for one node: the ranks' lifecycle, with the operator's
    calls in `steering` and jobs' owners and classes in `ownership`, all over one `SchedulerState`.

    Every public method takes the lock briefly and never blocks on I/O while
    holding it: messages go to each session's `deliver`, which never blocks.
    `clock`, `wall` and `pid_alive` are the outside world's, which tests replace.
    """

    def __init__(self, inventory: Inventory, settings: SchedulerSettings = SchedulerSettings(), *,
                 event_log: EventLog | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, pid_alive: Callable[[int], bool] = psutil.pid_exists) -> None:
        self.settings = settings
        sessions = Registry()
        leases = Leases(settings.lease, sessions, clock)
        phases = PhaseMachine(policies.create(settings.policy, settings.classes, wall() - clock()), sessions, leases,
                              Pages.if_possible() if settings.handover else None)
        self._state = state = SchedulerState(inventory, settings.node or os.uname().nodename,
                                             event_log or EventLog(), sessions, leases, phases, clock, wall)
        self.ownership = JobOwnership(state, settings.class_rules)
        phases.classes_differ = lambda device: self.ownership.classes_differ(
            {s.ref.key.job_id for s in sessions.on_device(device)})
        phases.priority_of = lambda job: int(self.ownership.class_of(job).priority)
        phases.caps_on = lambda device, on: caps(
            inventory.by_index(device).memory_total,
            {s.ref.key.job_id: self.ownership.class_of(s.ref.key.job_id).priority for s in on}, settings.memory)
        self._pid_alive = pid_alive
        # Its settings (`overdue_factor`, `overdue_after_s`, `overdue_warmup_s`, `max_hold_s`) may be changed
        # in place; `overdue_total` counts the holders it treated as stalled.
        self.liveness = Liveness(sessions, leases, phases, pid_alive, settings.liveness)
        self.steering = Steering(state, self.ownership, self.liveness, self.close, settings.classes,
                                 settings.payoff, settings.adapt)
        self.deadline_changed = phases.deadline_changed
        self._ids = itertools.count()

    @property
    def inventory(self) -> Inventory:
        return self._state.inventory

    @property
    def node(self) -> str:
        return self._state.node

    @property
    def events(self) -> EventLog:
        return self._state.events

    # ---- rank lifecycle ------------------------------------------------

    def register(self, ident: RankIdentity, accepts_leases: bool = False, asked: Priority | None = None,
                 accepts_preempt: bool = False, accepts_handover: bool = False) -> Registration:
        """Register a rank. `asked`: the class it asks for (it may lower what this node gives its user, once the
        kernel names the user on the session socket: `bind_peer`); `accepts_preempt`: it yields when asked;
        `accepts_handover`: it takes a turn page on the session socket (`attach`)."""
        validate_identity(ident, len(self._state.inventory.devices))
        ident = printable_identity(ident)
        device_index = ident.device if ident.device >= 0 else ident.local_rank % len(self._state.inventory.devices)
        device = self._state.inventory.by_index(device_index)
        key = RankKey(ident.job_id, ident.rank)
        process = _process(ident.pid)
        if process is None and ident.pid and not self._pid_alive(ident.pid):
            # A pid this daemon cannot see (a rank in a container's process namespace, or one that
            # is gone): unknown until its stream arrives on the session socket, whose peer the
            # kernel names (`bind_peer`); meanwhile its stream and heartbeats say whether it lives.
            ident = replace(ident, pid=0)
        with self._state.lock:
            now = self._state.clock()
            if self._state.closed:
                raise FailedPrecondition("the daemon is shutting down")
            most = self.settings.max_sessions
            if len(self._state.sessions) >= most:
                raise ResourceExhausted(f"this daemon holds {most} registered ranks, the most it takes "
                                        "(crossoverd --max-connections); try again once some have left")
            known = self._state.sessions.by_key(key)
            if known is not None:
                raise AlreadyExists(
                    f"rank {ident.rank} of job {ident.job_name!r} ({ident.job_id}) is already registered "
                    f"(pid {known.ident.pid})"
                )
            if device.index in self._state.leases.draining:
                device = self.steering.instead_of_drained(device, ident)
            sid = f"{uuid.uuid4().hex}{next(self._ids):x}"
            ref = RankRef(key, ident.job_name, device.index, ident.world_size, now)
            ident = replace(ident, node=self._state.node, device=device.index)
            sess = Session(sid, ident, ref, registered_at=now, last_seen=now, last_t=now, phase_since=now,
                           accepts_leases=accepts_leases, process=process, asked=asked,
                           accepts_preempt=accepts_preempt, accepts_handover=accepts_handover)
            note = self.ownership.give_class(sess, None, None)
            self._state.sessions.add(sess)
            d = Decision()
            d.log(sess, Register(pid=ident.pid, world_size=ident.world_size, framework=ident.framework))
            self._state.leases.revoke(device.index, "another rank joined the device", d)
            self._state.phases.deliver(self._state.phases.policy.join(ref, now), now, d)
            self.ownership.reclassify(key.job_id, now, d, tell=(sess, note))
            self._state.phases.tell_share(device.index, d)
            self._state.commit(d, now)
            blocks = self._state.phases.policy.blocks
            name = self._state.phases.policy.name
        _log.info("registered %s rank %d (pid %d) on device %d", ident.job_name, ident.rank, ident.pid, device.index)
        return Registration(sid, self._state.node, device.index, device.cpu_affinity,
                            self.settings.heartbeat_interval_s, name, blocks)

    def attach(self, session_id: str, deliver: Callable[[Message], None] | None = None,
               passes_fds: bool = False) -> queue.SimpleQueue | None:
        """Bind a session's stream. `deliver` receives every message for it (from any thread,
        never blocking); without one, an outbox queue is returned for the caller to drain.
        `passes_fds`: the stream carries file descriptors (the session socket), so a rank that
        takes one gets its turn page first (see `handover`)."""
        outbox: queue.SimpleQueue | None = None
        if deliver is None:
            outbox = queue.SimpleQueue()
            deliver = outbox.put
        with self._state.lock:
            sess = self._state.sessions.get(session_id)
            if sess.attached:
                raise AlreadyExists(f"session {session_id} already has an open stream")
            sess.attached = True
            sess.last_seen = self._state.clock()
            sess.deliver = deliver
            for msg in sess.undelivered:
                deliver(msg)
            sess.undelivered.clear()
            pages = self._state.phases.pages
            if passes_fds and sess.accepts_handover and pages is not None and pages.of(session_id) is None:
                try:
                    page = pages.open(session_id)
                except PagesUnavailable as exc:
                    _log.warning("no turn page for %s rank %d (%s): it waits for grants on its CPU",
                                 sess.ident.job_name, sess.ident.rank, exc)
                else:
                    sess.pages_sent.add(page.id)
                    deliver(PageMsg(page.id, page.fd, own=True))
        return outbox

    def apply(self, session_id: str, ev: RankEvent) -> None:
        """Apply one rank event: a message of the rank's stream that carries one (see `apply_message`)."""
        self.apply_message(session_id, (ev,))

    def apply_message(self, session_id: str, events: Sequence[RankEvent]) -> None:
        """Apply the events of one message of the rank's stream, in order (a BATCH carries several).

        A compute request reaches the policy with its iteration; a request with `no_wait` is
        not answered (the rank computes already). A `compute_done`
        with `comm_begins` also begins the rank's allreduce; with `requested` it also stands
        for the phase's request, made `duration_s` earlier and ending an allreduce of `comm_s`.
        A `compute_done` that `yields` frees the device in the middle of a compute phase: the
        rank is about to wait for other ranks (a collective) and asks again afterwards with the
        same iteration. Its pieces add up to one phase for the policy's compute estimates.
        `ago_s`: the rank reports the event late (a batch); it is applied and logged at the
        time it happened (liveness counts from its arrival), within what the daemon saw: never
        before the rank's previous event, nor before its previous message with events arrived
        (a client cannot backdate an event past that to jump the queue). A request that waits
        is sent at once, so it is dated when it arrives, whatever it says.
        """
        with self._state.lock:
            arrived = self._state.clock()
            if self._state.closed:  # shutting down: the grant or close already queued for this stream stands
                return
            sess = self._state.sessions.get(session_id)
            silent = arrived - sess.last_seen
            sess.last_seen = arrived
            floor = sess.floor_t
            for ev in events:
                d = Decision()
                # Batches travel with different delays, so a date can fall before the rank's previous
                # event; a rank's events are sequential: clamp, or its phases would overlap in the log.
                now = max(arrived - ev.ago_s, sess.last_t, floor)
                if ev.kind is EventKind.COMPUTE_REQUEST and not ev.no_wait:
                    now = max(arrived, sess.last_t)
                try:
                    if sess.phase is Phase.SUSPENDED:
                        self.liveness.resume(sess, silent, now, d)
                    self._state.phases.apply(sess, ev, now, d)
                finally:  # what was decided before an error stands: log it and send its messages
                    self._state.commit(d, now)
            if any(ev.kind is not EventKind.HEARTBEAT for ev in events):
                sess.floor_t = arrived

    def bind_peer(self, session_id: str, pid: int, uid: int, gid: int | None = None) -> None:
        """Bind a session to its connection's process and user as the kernel reports them (SO_PEERCRED).

        From then on liveness, `crossover queue`'s pid and per-user limits use the kernel's
        figures, not the rank's claim. `pid` 0: the peer's process namespace is not the daemon's
        (a container): the pid stays unknown and the connection alone says whether the rank lives.
        """
        process = _process(pid)
        with self._state.lock:
            sess = self._state.sessions.find(session_id)
            if sess is None:
                return
            self.ownership.check_owner(sess, uid)
            sess.uid = uid
            note = self.ownership.give_class(sess, uid, gid)
            d = Decision()
            now = self._state.clock()
            self.ownership.reclassify(sess.ref.key.job_id, now, d, tell=(sess, note) if note else None)
            self._state.commit(d, now)
            if pid != sess.ident.pid:
                if pid > 0 and sess.ident.pid:
                    _log.warning("%s rank %d claimed pid %d but its connection is pid %d; using the kernel's",
                                 sess.ident.job_name, sess.ident.rank, sess.ident.pid, pid)
                sess.ident = replace(sess.ident, pid=pid)
                sess.process = process

    def close(self, session_id: str, reason: str, evicted: bool = False) -> bool:
        """Remove a session (stream ended, process died, heartbeat lost); frees its grant.
        `evicted`: the daemon removed it (`reap`), rather than the rank ending its stream."""
        with self._state.lock:
            now = self._state.clock()
            sess = self._state.sessions.pop(session_id)
            if sess is None:
                return False
            d = Decision()
            d.log(sess, Leave(reason=reason, evicted=evicted))
            if sess.phase is Phase.COMPUTE:
                d.log(sess, Release(reason=reason))
            self._rescue(sess, reason, d, close=True)
            if sess.phase is not Phase.SUSPENDED:  # a suspended rank already left the policy
                self._state.phases.deliver(self._state.phases.policy.leave(sess.ref.key, now), now, d)
            self._state.phases.forget_lease(sess, now, d)
            d.post(sess, CloseMsg(reason))
            self._state.phases.tell_share(sess.ref.device, d)
            self.ownership.reclassify(sess.ref.key.job_id, now, d)
            self._state.commit(d, now)
        _log.info("removed %s rank %d: %s", sess.ident.job_name, sess.ident.rank, reason)
        return True

    def reap(self) -> list[str]:
        """Suspend ranks silent past the heartbeat timeout; evict those silent past `evict_after_s`
        or whose process is gone (see `liveness`). Returns the evicted session ids."""
        with self._state.lock:
            now = self._state.clock()
            d = Decision()
            doomed = self.liveness.sweep(now, d)
            pages = self._state.phases.pages
            # A turn may queue as much work as a holder may hold its device (`--max-hold`): owed past that, the
            # holder's device is taken for stuck, and the ticket is stored for it.
            for sid in pages.overdue(now, self.liveness.max_hold_s) if pages is not None else ():
                sess = self._state.sessions.find(sid)
                if sess is not None:
                    self._rescue(sess, "its device did not end its turn", d)
            self._state.commit(d, now)
        for sid, reason in doomed:
            self.close(sid, reason, evicted=True)
        self.tick()
        self.steering.adapt()
        return [sid for sid, _ in doomed]

    def _rescue(self, sess: Session, reason: str, d: Decision, close: bool = False) -> None:
        """Store the ticket the session's device still owes, so the rank after it goes on (lock held);
        `close`: the session is gone, and its page with it."""
        pages = self._state.phases.pages
        if pages is None:
            return
        ticket = pages.close(sess.id) if close else pages.rescue(sess.id)
        if ticket:
            d.log(sess, HandoverRescue(ticket=ticket, reason=reason))

    def tick(self) -> None:
        """Let the policy act on deadlines that have passed (bounded waits)."""
        d = Decision()
        with self._state.lock:
            now = self._state.clock()
            self._state.phases.deliver(self._state.phases.policy.tick(now), now, d)
            self._state.commit(d, now)

    def next_deadline(self) -> float | None:
        """When `tick` must next run (monotonic seconds), or None; `deadline_changed` is set when it moves."""
        with self._state.lock:
            return self._state.phases.policy.next_deadline()

    def shutdown(self) -> None:
        """Fail open: every waiting rank is granted, every stream is closed."""
        with self._state.lock:
            now = self._state.clock()
            self._state.closed = True
            sessions = self._state.sessions.clear()
            for sess in sessions:
                if sess.phase is Phase.WAITING or sess.suspended_from is Phase.WAITING:
                    sess.send(GrantMsg(sess.pending_seq, sess.iteration, now - sess.requested_at))
                sess.send(CloseMsg("daemon shutting down"))
            if self._state.phases.pages is not None:  # no rank's device waits on a page of a rank gone with the daemon
                self._state.phases.pages.close_all()
        for sess in sessions:
            record_rank(self.events, Leave(reason="daemon shutdown"), sess, self._state.node, None)
        self.events.close()

