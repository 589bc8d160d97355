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
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Callable

import psutil

from crossover.daemon import policies
from crossover.daemon.api import (
    AlreadyExists,
    FailedPrecondition,
    Phase,
    Policy,
    RankKey,
    RankRef,
    ResourceExhausted,
)
from crossover.daemon.class_rules import ClassRules
from crossover.daemon.event_log import EventLog
from crossover.daemon.events import Decision, EventKind, RankEvent, record_rank
from crossover.daemon.grant_payoff import PayoffJudge, PayoffSettings
from crossover.daemon.handover import Pages, PagesUnavailable
from crossover.daemon.inventory import Inventory
from crossover.daemon.leases import Leases
from crossover.daemon.liveness import Liveness, LivenessSettings
from crossover.daemon.messages import CloseMsg, GrantMsg, Message, PageMsg, PreemptMsg
from crossover.daemon.phases import PhaseMachine
from crossover.daemon.policies.classes import ClassSettings, JobClass, Priority
from crossover.daemon.policies.memory import MemoryRules, caps
from crossover.daemon.registry import Registration, Registry, Session, printable_identity, validate_identity
from crossover.daemon.steering import Steering
from crossover.protos.event_file import EventName
from crossover.protos.identity import RankIdentity

__all__ = ["Scheduler"]

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


class Scheduler(Steering):
    """Thread-safe registry plus policy executor for one node.

    Every public method takes the lock briefly and never blocks on I/O while
    holding it: messages go to each session's `deliver`, which never blocks.
    The clock is read under the lock in every decision: a thread preempted between
    reading it and taking the lock would otherwise log its decision before one it follows.
    """

    def __init__(
        self,
        inventory: Inventory,
        policy: str | Policy = "exclusive",
        node: str = "",
        event_log: EventLog | None = None,
        heartbeat_interval_s: float = 0.2,
        liveness: LivenessSettings = LivenessSettings(),
        clock: Callable[[], float] = time.monotonic,
        pid_alive: Callable[[int], bool] = psutil.pid_exists,
        lease: bool = True,
        max_sessions: int = 2048,
        payoff: PayoffSettings | None = None,
        wall: Callable[[], float] = time.time,
        adapt: bool | None = None,
        class_rules: ClassRules | None = None,
        class_settings: ClassSettings | None = None,
        handover: bool = True,
        memory: MemoryRules = MemoryRules(),
    ) -> None:
        self._sessions = Registry()
        self._leases = Leases(lease, self._sessions, clock)
        self._class_settings = class_settings
        self._phases = PhaseMachine(policies.create(policy, class_settings, wall() - clock())
                                    if isinstance(policy, str) else policy,
                                    self._sessions, self._leases, Pages.if_possible() if handover else None)
        self._phases.classes_differ = lambda device: self._classes_differ(
            {s.ref.key.job_id for s in self._sessions.on_device(device)})
        self._phases.priority_of = lambda job: int(self._classes.get(job, (JobClass(), ""))[0].priority)
        self._rules = class_rules or ClassRules()
        self.memory = memory  # the memory reservations by class (`crossoverd --reserve`)
        self._phases.caps_on = lambda device, on: caps(
            self.inventory.by_index(device).memory_total,
            {s.ref.key.job_id: self._classes.get(s.ref.key.job_id, (JobClass(), ""))[0].priority for s in on},
            self.memory)
        self._classes: dict[str, tuple[JobClass, str]] = {}  # job -> its class as the policy has it, and by what
        self._set_by_operator: dict[str, JobClass] = {}  # job -> the class `crossover priority/share` set
        self._pid_alive = pid_alive
        # Registered sessions at once: each registration costs every session on its device a share
        # update, so a flood of them (sessions that never open a stream live 5 s) is bounded.
        self.max_sessions = max_sessions
        # Its settings (`overdue_factor`, `overdue_after_s`, `overdue_warmup_s`, `max_hold_s`) may be changed
        # in place; `overdue_total` counts the holders it treated as stalled.
        self.liveness = Liveness(self._sessions, self._leases, self._phases, pid_alive, liveness)
        self.inventory = inventory
        self.node = node or os.uname().nodename
        self.events = event_log or EventLog()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.deadline_changed = self._phases.deadline_changed
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._closed = False
        self._ids = itertools.count()
        self._drain_refused: dict[int, int] = {}  # device -> ranks refused since its drain began
        self._payoff = payoff or PayoffSettings()
        self._adapting = payoff is not None if adapt is None else adapt  # off: grants everywhere
        self._wall = wall
        self._judges: dict[int, PayoffJudge] = {}

    def _classes_differ(self, jobs: Iterable[str]) -> bool:
        """Whether these jobs are of different classes or weights on this node (lock held)."""
        return len({self._classes.get(job, (JobClass(), ""))[0] for job in jobs}) > 1

    # ---- rank lifecycle ------------------------------------------------

    def register(self, ident: RankIdentity, accepts_leases: bool = False, asked: Priority | None = None,
                 accepts_preempt: bool = False, accepts_handover: bool = False) -> Registration:
        """Register a rank. `asked`: the class it asks for (it may lower what this node gives its user, once the
        kernel names the user on the session socket: `bind_peer`); `accepts_preempt`: it yields when asked;
        `accepts_handover`: it takes a turn page on the session socket (`attach`)."""
        validate_identity(ident, len(self.inventory.devices))
        ident = printable_identity(ident)
        device_index = ident.device if ident.device >= 0 else ident.local_rank % len(self.inventory.devices)
        device = self.inventory.by_index(device_index)
        key = RankKey(ident.job_id, ident.rank)
        process = _process(ident.pid)
        if process is None and ident.pid and not self._pid_alive(ident.pid):
            # A pid this daemon cannot see (a rank in a container's process namespace, or one that
            # is gone): unknown until its stream arrives on the session socket, whose peer the
            # kernel names (`bind_peer`); meanwhile its stream and heartbeats say whether it lives.
            ident = replace(ident, pid=0)
        with self._lock:
            now = self._clock()
            if self._closed:
                raise FailedPrecondition("the daemon is shutting down")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"this daemon holds {self.max_sessions} registered ranks, the most it takes "
                                        "(crossoverd --max-connections); try again once some have left")
            known = self._sessions.by_key(key)
            if known is not None:
                raise AlreadyExists(
                    f"rank {ident.rank} of job {ident.job_name!r} ({ident.job_id}) is already registered "
                    f"(pid {known.ident.pid})"
                )
            if device.index in self._leases.draining:
                device = self._instead_of_drained(device, ident)
            sid = f"{uuid.uuid4().hex}{next(self._ids):x}"
            ref = RankRef(key, ident.job_name, device.index, ident.world_size, now)
            ident = replace(ident, node=self.node, device=device.index)
            sess = Session(sid, ident, ref, registered_at=now, last_seen=now, last_t=now, phase_since=now,
                           accepts_leases=accepts_leases, process=process, asked=asked,
                           accepts_preempt=accepts_preempt, accepts_handover=accepts_handover)
            note = self._give_class(sess, None, None)
            self._sessions.add(sess)
            d = Decision()
            d.log(EventName.REGISTER, sess, pid=ident.pid, world_size=ident.world_size, framework=ident.framework)
            self._leases.revoke(device.index, "another rank joined the device", d)
            self._phases.deliver(self._phases.policy.join(ref, now), now, d)
            self._reclassify(key.job_id, now, d, tell=(sess, note))
            self._phases.tell_share(device.index, d)
            self._commit(d, now)
            blocks = self._phases.policy.blocks
            name = self._phases.policy.name
        _log.info("registered %s rank %d (pid %d) on device %d", ident.job_name, ident.rank, ident.pid, device.index)
        return Registration(sid, self.node, device.index, device.cpu_affinity, self.heartbeat_interval_s, name, blocks)

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
        with self._lock:
            sess = self._sessions.get(session_id)
            if sess.attached:
                raise AlreadyExists(f"session {session_id} already has an open stream")
            sess.attached = True
            sess.last_seen = self._clock()
            sess.deliver = deliver
            for msg in sess.undelivered:
                deliver(msg)
            sess.undelivered.clear()
            pages = self._phases.pages
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

    def event(self, session_id: str, kind: str, iteration: int = 0, seq: int = 0, duration_s: float = 0.0,
              *, comm_begins: bool = False, no_wait: bool = False, requested: bool = False,
              comm_s: float = 0.0, ago_s: float = 0.0, yields: bool = False) -> None:
        """Apply one rank event given by its kind's name (`compute_request`, `compute_done`, `comm_begin`,
        `comm_end`, `heartbeat`, `lease_released`) and fields; see `RankEvent` and `apply`."""
        self.apply(session_id, RankEvent.named(
            kind, iteration=iteration, seq=seq, duration_s=duration_s, comm_begins=comm_begins, no_wait=no_wait,
            requested=requested, comm_s=comm_s, ago_s=ago_s, yields=yields))

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
        with self._lock:
            arrived = self._clock()
            if self._closed:  # shutting down: the grant or close already queued for this stream stands
                return
            sess = self._sessions.get(session_id)
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
                    self._phases.apply(sess, ev, now, d)
                finally:  # what was decided before an error stands: log it and send its messages
                    self._commit(d, now)
            if any(ev.kind is not EventKind.HEARTBEAT for ev in events):
                sess.floor_t = arrived

    def bind_peer(self, session_id: str, pid: int, uid: int, gid: int | None = None) -> None:
        """Bind a session to its connection's process and user as the kernel reports them (SO_PEERCRED).

        From then on liveness, `crossover queue`'s pid and per-user limits use the kernel's
        figures, not the rank's claim. `pid` 0: the peer's process namespace is not the daemon's
        (a container): the pid stays unknown and the connection alone says whether the rank lives.
        """
        process = _process(pid)
        with self._lock:
            sess = self._sessions.find(session_id)
            if sess is None:
                return
            self._check_owner(sess, uid)
            sess.uid = uid
            note = self._give_class(sess, uid, gid)
            d = Decision()
            now = self._clock()
            self._reclassify(sess.ref.key.job_id, now, d, tell=(sess, note) if note else None)
            self._commit(d, now)
            if pid != sess.ident.pid:
                if pid > 0 and sess.ident.pid:
                    _log.warning("%s rank %d claimed pid %d but its connection is pid %d; using the kernel's",
                                 sess.ident.job_name, sess.ident.rank, sess.ident.pid, pid)
                sess.ident = replace(sess.ident, pid=pid)
                sess.process = process

    def close(self, session_id: str, reason: str, evicted: bool = False) -> bool:
        """Remove a session (stream ended, process died, heartbeat lost); frees its grant.
        `evicted`: the daemon removed it (`reap`), rather than the rank ending its stream."""
        with self._lock:
            now = self._clock()
            sess = self._sessions.pop(session_id)
            if sess is None:
                return False
            d = Decision()
            d.log(EventName.LEAVE, sess, reason=reason, evicted=evicted)
            if sess.phase is Phase.COMPUTE:
                d.log(EventName.RELEASE, sess, reason=reason)
            self._rescue(sess, reason, d, close=True)
            if sess.phase is not Phase.SUSPENDED:  # a suspended rank already left the policy
                self._phases.deliver(self._phases.policy.leave(sess.ref.key, now), now, d)
            self._phases.forget_lease(sess, now, d)
            d.post(sess, CloseMsg(reason))
            self._phases.tell_share(sess.ref.device, d)
            self._reclassify(sess.ref.key.job_id, now, d)
            self._commit(d, now)
        _log.info("removed %s rank %d: %s", sess.ident.job_name, sess.ident.rank, reason)
        return True

    def reap(self) -> list[str]:
        """Suspend ranks silent past the heartbeat timeout; evict those silent past `evict_after_s`
        or whose process is gone (see `liveness`). Returns the evicted session ids."""
        with self._lock:
            now = self._clock()
            d = Decision()
            doomed = self.liveness.sweep(now, d)
            pages = self._phases.pages
            # A turn may queue as much work as a holder may hold its device (`--max-hold`): owed past that, the
            # holder's device is taken for stuck, and the ticket is stored for it.
            for sid in pages.overdue(now, self.liveness.max_hold_s) if pages is not None else ():
                sess = self._sessions.find(sid)
                if sess is not None:
                    self._rescue(sess, "its device did not end its turn", d)
            self._commit(d, now)
        for sid, reason in doomed:
            self.close(sid, reason, evicted=True)
        self.tick()
        self.adapt()
        return [sid for sid, _ in doomed]

    def _rescue(self, sess: Session, reason: str, d: Decision, close: bool = False) -> None:
        """Store the ticket the session's device still owes, so the rank after it goes on (lock held);
        `close`: the session is gone, and its page with it."""
        pages = self._phases.pages
        if pages is None:
            return
        ticket = pages.close(sess.id) if close else pages.rescue(sess.id)
        if ticket:
            d.log(EventName.HANDOVER_RESCUE, sess, ticket=ticket, reason=reason)

    def tick(self) -> None:
        """Let the policy act on deadlines that have passed (bounded waits)."""
        d = Decision()
        with self._lock:
            now = self._clock()
            self._phases.deliver(self._phases.policy.tick(now), now, d)
            self._commit(d, now)

    def next_deadline(self) -> float | None:
        """When `tick` must next run (monotonic seconds), or None; `deadline_changed` is set when it moves."""
        with self._lock:
            return self._phases.policy.next_deadline()

    def shutdown(self) -> None:
        """Fail open: every waiting rank is granted, every stream is closed."""
        with self._lock:
            now = self._clock()
            self._closed = True
            sessions = self._sessions.clear()
            for sess in sessions:
                if sess.phase is Phase.WAITING or sess.suspended_from is Phase.WAITING:
                    sess.send(GrantMsg(sess.pending_seq, sess.iteration, now - sess.requested_at))
                sess.send(CloseMsg("daemon shutting down"))
            if self._phases.pages is not None:  # no rank's device waits on a page of a rank gone with the daemon
                self._phases.pages.close_all()
        for sess in sessions:
            record_rank(self.events, EventName.LEAVE, sess, self.node, None, {"reason": "daemon shutdown"})
        self.events.close()


    def _commit(self, d: Decision, now: float) -> None:
        """Log the decision's entries, then send its messages; called with the lock held, so the
        log's order is the order decisions were made (tests and benchmarks check policies against it).
        Holders the policy now wants to yield to a higher class are asked to, in the same decision."""
        for key in self._phases.policy.take_preemptions():
            sess = self._sessions.by_key(key)
            if sess is not None and sess.accepts_preempt:
                d.log(EventName.PREEMPT, sess)
                d.post(sess, PreemptMsg())
        d.commit(self.events, self.node, now)
        for device, change in self._phases.policy.take_isolation_changes():  # dated the decision's instant
            self.events.record(EventName.ISOLATION, t=now, device=device, window=change.window.value,
                               budget=change.budget, reference_s=change.reference_s, current_s=change.current_s,
                               reason=change.reason)
