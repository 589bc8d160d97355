"""The daemon's core: sessions, event handling, grant dispatch and liveness.

The policy decides; this module acts. It keeps the registry of rank sessions,
feeds their events to the policy under one lock, delivers grants to each
session's outbox (a queue the gRPC stream drains), and evicts ranks whose
stream ended, whose process died or whose heartbeats stopped. It knows
nothing of gRPC: `server.py` translates.

Leases. A rank alone on its device under a blocking policy would be granted
every request at once, so it is given a lease: it keeps reporting its phases
but stops waiting for each grant (a round trip per iteration saved). The
lease is revoked when another rank joins the device, on a drain or a policy
switch. Until the holder confirms (LEASE_RELEASED, which follows every request
it made under the lease on its stream), other ranks' requests on that device
are held back from the policy, so the policy never grants the device while
the holder might be computing unseen.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import psutil

from . import policies
from .api import (
    AlreadyExists,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Phase,
    Policy,
    RankKey,
    RankRef,
)
from .event_log import EventLog
from .inventory import Inventory

__all__ = [
    "Scheduler", "Identity", "Registration", "GrantMsg", "PolicyMsg", "LeaseMsg", "ShareMsg", "AliveMsg",
    "CloseMsg",
    "RankSnapshot", "DeviceSnapshot",
]

_log = logging.getLogger(__name__)

_MAX_WORLD = 1 << 20
_MAX_TURN = 1 << 53  # turns are counters; anything larger is a corrupt field


@dataclass(frozen=True)
class Identity:
    job_id: str
    job_name: str
    rank: int
    local_rank: int
    world_size: int
    local_size: int
    node: str
    device: int
    pid: int


@dataclass(frozen=True)
class Registration:
    session_id: str
    node: str
    device: int
    cpu_affinity: tuple[int, ...]
    heartbeat_interval_s: float
    policy: str
    policy_blocks: bool


@dataclass(frozen=True)
class GrantMsg:
    seq: int
    iteration: int
    waited_s: float


@dataclass(frozen=True)
class PolicyMsg:
    policy: str
    blocks: bool


@dataclass(frozen=True)
class LeaseMsg:
    """The session may compute without waiting for grants (held) or must wait again (revoked)."""

    held: bool


@dataclass(frozen=True)
class ShareMsg:
    """How many other ranks are registered on the session's device now."""

    other_ranks: int


@dataclass(frozen=True)
class AliveMsg:
    """The answer to a heartbeat: the daemon still reads and decides."""


@dataclass(frozen=True)
class CloseMsg:
    """Ends a session's stream; `error` set means the rank sent something invalid."""

    reason: str
    error: Exception | None = None


@dataclass
class _Stats:
    compute_total: float = 0.0
    compute_n: int = 0
    comm_total: float = 0.0
    comm_n: int = 0
    waited_total: float = 0.0
    compute_ema: float | None = None  # its whole compute phases (yielded pieces added up)


@dataclass
class _Session:
    id: str
    ident: Identity
    ref: RankRef
    registered_at: float
    last_seen: float
    deliver: Callable[[Any], None] | None = None
    undelivered: list = field(default_factory=list)  # messages sent before the stream attached
    attached: bool = False
    phase: Phase = Phase.IDLE
    phase_since: float = 0.0
    iteration: int = -1
    pending_seq: int = 0
    requested_at: float = 0.0
    turn: int = 0  # the pending request's place in the rotation
    suspended_from: Phase | None = None  # the phase it was silenced in (while SUSPENDED)
    forgive_done: bool = False  # its grant was taken while it was silent: a late COMPUTE_DONE is no error
    yielded_s: float = 0.0  # device time of the current iteration's phase before it yielded (see `event`)
    accepts_leases: bool = False
    no_wait: bool = False  # the rank computes without waiting for the pending request's grant
    last_t: float = 0.0  # the date of its latest logged entry: its next ones are never dated earlier
    stats: _Stats = field(default_factory=_Stats)
    process: psutil.Process | None = None

    def send(self, msg: Any) -> None:
        if self.deliver is None:
            self.undelivered.append(msg)
        else:
            self.deliver(msg)


class DeviceSnapshot(NamedTuple):
    holders: list[RankSnapshot]
    waiting: list[RankSnapshot]
    others: list[RankSnapshot]
    order: tuple[str, ...]


@dataclass(frozen=True)
class RankSnapshot:
    ident: Identity
    phase: Phase
    iteration: int
    mean_compute_s: float
    mean_comm_s: float
    wait_fraction: float
    since_s: float
    registered_s: float
    cpu_percent: float
    rss_bytes: int


class Scheduler:
    """Thread-safe registry plus policy executor for one node.

    Every public method takes the lock briefly and never blocks on I/O while
    holding it: grants go into unbounded per-session queues.
    """

    def __init__(
        self,
        inventory: Inventory,
        policy: str | Policy = "exclusive",
        node: str = "",
        event_log: EventLog | None = None,
        heartbeat_interval_s: float = 0.2,
        heartbeat_timeout_s: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        pid_alive: Callable[[int], bool] = psutil.pid_exists,
        evict_after_s: float = 10.0,
        lease: bool = True,
        overdue_factor: float = 10.0,
        overdue_after_s: float = 3.0,
    ) -> None:
        if evict_after_s < heartbeat_timeout_s:
            raise InvalidRequest(
                f"evict_after_s={evict_after_s} is shorter than heartbeat_timeout_s={heartbeat_timeout_s}")
        self.inventory = inventory
        self.node = node or os.uname().nodename
        self.events = event_log or EventLog()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.evict_after_s = evict_after_s
        self.overdue_factor = overdue_factor
        self.overdue_after_s = overdue_after_s
        self.overdue_total = 0  # holders treated as stalled since start (see `reap`)
        self._clock = clock
        self._pid_alive = pid_alive
        self._lock = threading.Lock()
        self._policy: Policy = policies.create(policy) if isinstance(policy, str) else policy
        self._sessions: dict[str, _Session] = {}
        self._by_key: dict[RankKey, _Session] = {}
        self._draining: set[int] = set()
        self._lease_enabled = lease
        self._leases: dict[int, str] = {}  # device -> session holding its lease
        self._revoking: dict[int, dict[str, float]] = {}  # device -> {session whose LEASE_RELEASED is awaited: since}
        self._deferred: dict[int, dict[str, None]] = {}  # device -> sessions whose request waits for it
        self._unsent: list[tuple[_Session, Any]] = []  # a decision's messages, sent once its entries are logged
        self._started = clock()
        self._closed = False
        self._ids = itertools.count()
        self.deadline_changed = threading.Event()

    # ---- rank lifecycle ------------------------------------------------

    def register(self, ident: Identity, accepts_leases: bool = False) -> Registration:
        _validate(ident, len(self.inventory.devices))
        device_index = ident.device if ident.device >= 0 else ident.local_rank % len(self.inventory.devices)
        device = self.inventory.by_index(device_index)
        key = RankKey(ident.job_id, ident.rank)
        with self._lock:
            now = self._clock()
            if self._closed:
                raise FailedPrecondition("the daemon is shutting down")
            if key in self._by_key:
                raise AlreadyExists(
                    f"rank {ident.rank} of job {ident.job_name!r} ({ident.job_id}) is already registered "
                    f"(pid {self._by_key[key].ident.pid})"
                )
            if device.index in self._draining:
                raise FailedPrecondition(
                    f"device {device.index} is draining and takes no new ranks; `crossover resume {device.index}`"
                )
            sid = f"{uuid.uuid4().hex}{next(self._ids):x}"
            ref = RankRef(key, ident.job_name, device.index, ident.world_size, now)
            ident = Identity(**{**ident.__dict__, "node": self.node, "device": device.index})
            sess = _Session(sid, ident, ref, registered_at=now, last_seen=now, last_t=now, phase_since=now,
                            accepts_leases=accepts_leases)
            try:
                sess.process = psutil.Process(ident.pid)
            except (psutil.Error, ValueError):
                sess.process = None
            self._sessions[sid] = sess
            self._by_key[key] = sess
            joined: list[tuple[str, _Session, dict]] = [
                ("register", sess, {"pid": ident.pid, "world_size": ident.world_size})]
            self._revoke(device.index, "another rank joined the device", joined)
            self._deliver(self._policy.join(ref, now), now, joined)
            self._tell_share(device.index)
            self._flush(joined, now)
            blocks = self._policy.blocks
            name = self._policy.name
        _log.info("registered %s rank %d (pid %d) on device %d", ident.job_name, ident.rank, ident.pid, device.index)
        return Registration(sid, self.node, device.index, device.cpu_affinity, self.heartbeat_interval_s, name, blocks)

    def attach(self, session_id: str, deliver: Callable[[Any], None] | None = None) -> queue.SimpleQueue | None:
        """Bind a session's stream. `deliver` receives every message for it (from any thread,
        never blocking); without one, an outbox queue is returned for the caller to drain."""
        outbox: queue.SimpleQueue | None = None
        if deliver is None:
            outbox = queue.SimpleQueue()
            deliver = outbox.put
        with self._lock:
            sess = self._session(session_id)
            if sess.attached:
                raise AlreadyExists(f"session {session_id} already has an open stream")
            sess.attached = True
            sess.last_seen = self._clock()
            sess.deliver = deliver
            for msg in sess.undelivered:
                deliver(msg)
            sess.undelivered.clear()
        return outbox

    def event(self, session_id: str, kind: str, iteration: int = 0, seq: int = 0, duration_s: float = 0.0,
              turn_base: int = 0, *, comm_begins: bool = False, no_wait: bool = False, requested: bool = False,
              comm_s: float = 0.0, ago_s: float = 0.0, yields: bool = False) -> None:
        """Apply one rank event: `compute_request`, `compute_done`, `comm_begin`, `comm_end`, `heartbeat`,
        `lease_released`.

        A compute request's place in the policy's order is its turn, `turn_base + iteration`;
        a request with `no_wait` is not answered (the rank computes already). A `compute_done`
        with `comm_begins` also begins the rank's allreduce; with `requested` it also stands
        for the phase's request, made `duration_s` earlier and ending an allreduce of `comm_s`.
        A `compute_done` that `yields` frees the device in the middle of a compute phase: the
        rank is about to wait for other ranks (a collective) and asks again afterwards with the
        same iteration. Its pieces add up to one phase for the policy's compute estimates.
        `ago_s`: the rank reports the event late (a batch); it is applied and logged at the
        time it happened (liveness counts from its arrival).
        """
        for name, value in (("duration_s", duration_s), ("comm_s", comm_s), ("ago_s", ago_s)):
            if value < 0 or value > 86_400 or value != value:
                raise InvalidRequest(f"{name}={value} is not a plausible phase length")
        if iteration < -1:
            raise InvalidRequest(f"iteration={iteration} is negative")
        if turn_base < 0 or turn_base > _MAX_TURN:
            raise InvalidRequest(f"turn_base={turn_base} is outside 0..{_MAX_TURN}")
        record: list[tuple[str, _Session, dict]] = []
        with self._lock:
            # The clock is read under the lock, here and in every other decision: a thread
            # preempted between reading it and taking the lock would otherwise log its
            # decision before one it follows.
            arrived = self._clock()
            now = arrived - ago_s
            if self._closed:  # shutting down: the grant or close already queued for this stream stands
                return
            try:
                sess = self._session(session_id)
                silent = arrived - sess.last_seen
                sess.last_seen = arrived
                # A dated event is its batch's arrival less its age; batches travel with different
                # delays, so a date can fall before the rank's previous event. A rank's events are
                # sequential: clamp, or its own consecutive phases would overlap in the log.
                previous = sess.last_t
                now = max(now, previous)
                if sess.phase is Phase.SUSPENDED:
                    self._resume(sess, silent, now, record)
                if kind == "heartbeat":
                    self._post(sess, AliveMsg())
                    return
                if kind == "compute_request":
                    self._request(sess, iteration, seq, turn_base, duration_s, no_wait, now, record)
                elif kind == "compute_done":
                    if requested:  # its request rode along: apply it first, dated when the phase began
                        began = max(now - duration_s, previous)
                        mark = len(record)
                        self._request(sess, iteration, seq, turn_base, comm_s, True, now, record)
                        for _, _, fields in record[mark:]:
                            fields["t"] = began
                        sess.requested_at = began
                        if sess.phase is Phase.COMPUTE:
                            sess.phase_since = began
                    self._finish_compute(sess, now, record, duration_s, strict=not sess.forgive_done, yields=yields)
                    sess.forgive_done = False
                    if comm_begins:
                        self._begin_comm(sess, iteration, now, record)
                elif kind == "comm_begin":
                    if sess.phase in (Phase.COMPUTE, Phase.WAITING, Phase.OVERDUE):
                        self._finish_compute(sess, now, record, 0.0, strict=False)
                    self._begin_comm(sess, iteration, now, record)
                elif kind == "comm_end":
                    self._end_comm(sess, iteration, duration_s, now, record)
                elif kind == "lease_released":
                    if sess.id in self._revoking.get(sess.ref.device, {}):
                        record.append(("lease_released", sess, {}))
                        self._end_revoke(sess.ref.device, sess.id, now, record)
                else:
                    raise InvalidRequest(f"unknown event kind {kind!r}")
            finally:  # what was decided before an error stands: log it and send its messages
                self._flush(record, now)

    def _request(self, sess: _Session, iteration: int, seq: int, turn_base: int, comm_s: float, no_wait: bool,
                 now: float, record: list) -> None:
        if sess.phase in (Phase.WAITING, Phase.COMPUTE):
            raise FailedPrecondition(f"rank {sess.ref.key} requested the device while in phase {sess.phase.value}")
        if sess.phase is Phase.COMM:  # the request carries the end of the allreduce before it
            self._end_comm(sess, iteration - 1, comm_s, now, record)
        sess.iteration = max(sess.iteration, iteration)
        sess.pending_seq = seq
        sess.requested_at = now
        sess.turn = turn_base + iteration
        sess.forgive_done = False
        sess.no_wait = no_wait
        self._queue_request(sess, iteration, now, record)

    def turn_floor(self, session_id: str) -> int:
        """Where the session's job should join its device's rotation (see `Policy.turn_floor`)."""
        with self._lock:
            sess = self._session(session_id)
            return self._policy.turn_floor(sess.ref.device, sess.ref.key.job_id)

    def close(self, session_id: str, reason: str) -> bool:
        """Remove a session (stream ended, process died, heartbeat lost); frees its grant."""
        with self._lock:
            now = self._clock()
            sess = self._sessions.pop(session_id, None)
            if sess is None:
                return False
            del self._by_key[sess.ref.key]
            record: list[tuple[str, _Session, dict]] = []
            if sess.phase is Phase.COMPUTE:
                record.append(("release", sess, {"reason": reason}))
            if sess.phase is not Phase.SUSPENDED:  # a suspended rank already left the policy
                self._deliver(self._policy.leave(sess.ref.key, now), now, record)
            self._forget_lease(sess, now, record)
            self._post(sess, CloseMsg(reason))
            record.insert(0, ("leave", sess, {"reason": reason}))
            self._tell_share(sess.ref.device)
            self._flush(record, now)
        _log.info("removed %s rank %d: %s", sess.ident.job_name, sess.ident.rank, reason)
        return True

    def reap(self) -> list[str]:
        """Suspend ranks silent past the heartbeat timeout; evict those silent past `evict_after_s`
        or whose process is gone. Returns the evicted session ids.

        Suspension frees the device at once but keeps the session: a rank that
        was only starved of CPU for a moment (a loaded node) carries on where it
        was when it speaks again, instead of training unscheduled until it
        re-registers.
        """
        with self._lock:
            now = self._clock()
            doomed = []
            record: list[tuple[str, _Session, dict]] = []
            for sess in self._sessions.values():
                silent = now - sess.last_seen
                if sess.attached and silent > self.evict_after_s:
                    doomed.append((sess.id, f"no heartbeat for {silent:.2f}s"))
                elif not sess.attached and now - sess.registered_at > max(5.0, 4 * self.heartbeat_timeout_s):
                    doomed.append((sess.id, "registered but never opened its stream"))
                elif not self._pid_alive(sess.ident.pid):
                    doomed.append((sess.id, f"process {sess.ident.pid} is gone"))
                elif sess.attached and silent > self.heartbeat_timeout_s and sess.phase is not Phase.SUSPENDED:
                    self._suspend(sess, silent, now, record)
                elif sess.phase is Phase.COMPUTE:
                    self._check_overdue(sess, now, record)
            for device, holders in list(self._revoking.items()):
                for sid, since in list(holders.items()):
                    if now - since > self.heartbeat_timeout_s:  # a client that never answers must not block others
                        holder = self._sessions[sid]
                        _log.warning("%s rank %d did not give up computing without grants on device %d within "
                                     "%.2fs; serving the device's other ranks anyway", holder.ident.job_name,
                                     holder.ident.rank, device, self.heartbeat_timeout_s)
                        record.append(("lease_expired", holder, {}))
                        self._end_revoke(device, sid, now, record)
            self._flush(record, now)
        for sid, reason in doomed:
            self.close(sid, reason)
        self.tick()
        return [sid for sid, _ in doomed]

    def tick(self) -> None:
        """Let the policy act on deadlines that have passed (bounded waits)."""
        record: list[tuple[str, _Session, dict]] = []
        with self._lock:
            now = self._clock()
            self._deliver(self._policy.tick(now), now, record)
            self._flush(record, now)

    def next_deadline(self) -> float | None:
        """When `tick` must next run (monotonic seconds), or None; `deadline_changed` is set when it moves."""
        with self._lock:
            return self._policy.next_deadline()

    def shutdown(self) -> None:
        """Fail open: every waiting rank is granted, every stream is closed."""
        with self._lock:
            now = self._clock()
            self._closed = True
            sessions = list(self._sessions.values())
            for sess in sessions:
                if sess.phase is Phase.WAITING or sess.suspended_from is Phase.WAITING:
                    sess.send(GrantMsg(sess.pending_seq, sess.iteration, now - sess.requested_at))
                sess.send(CloseMsg("daemon shutting down"))
            self._sessions.clear()
            self._by_key.clear()
        for sess in sessions:
            self._record("leave", sess, reason="daemon shutdown")
        self.events.close()

    # ---- operator side -------------------------------------------------

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def set_policy(self, name: str) -> str:
        """Switch policy at once; ranks computing or waiting are re-queued under the new one."""
        new = policies.create(name)
        record: list[tuple[str, _Session, dict]] = []
        with self._lock:
            now = self._clock()
            old = self._policy.name
            for device in list(self._leases):
                self._revoke(device, f"policy switched to {name}", record)
            if new.blocks and not self._policy.blocks:
                # Ranks computed without grants and report late: each must first say what it
                # is doing (its answer follows any request it computes under), as for a lease.
                for sess in self._sessions.values():
                    if sess.accepts_leases and sess.phase is not Phase.SUSPENDED:
                        self._await_release(sess, f"policy switched to {name}", record)
            self._policy = new
            for sess in sorted(self._sessions.values(), key=lambda s: s.registered_at):
                if sess.phase is not Phase.SUSPENDED:
                    new.join(sess.ref, now)
            active = [s for s in self._sessions.values() if s.phase in (Phase.COMPUTE, Phase.WAITING)]
            active.sort(key=lambda s: (s.phase is not Phase.COMPUTE, s.requested_at))
            for sess in active:
                if not self._defer(sess):  # a rank granted under the old policy computes: it keeps its device
                    claim = new.occupy if sess.phase is Phase.COMPUTE else new.request
                    self._deliver(claim(sess.ref.key, sess.turn, now), now, record)
            for sess in self._sessions.values():
                self._post(sess, PolicyMsg(new.name, new.blocks))
            self._flush(record, now)
        self.events.record("policy", old=old, new=name)
        _log.info("policy %s -> %s", old, name)
        return name

    def drain(self, device: int, draining: bool) -> bool:
        self.inventory.by_index(device)
        record: list[tuple[str, _Session, dict]] = []
        with self._lock:
            now = self._clock()
            (self._draining.add if draining else self._draining.discard)(device)
            if draining:
                self._revoke(device, "device draining", record)
            self._flush(record, now)
        self.events.record("drain" if draining else "resume", device=device)
        return draining

    def is_draining(self, device: int) -> bool:
        with self._lock:
            return device in self._draining

    def uptime(self) -> float:
        return self._clock() - self._started

    def snapshot(self) -> tuple[dict[int, DeviceSnapshot], list[RankSnapshot]]:
        """Per device: (holders, waiting in grant order, others, job order); plus all ranks.

        Requests held back while a lease is given up are listed last among the waiting.
        """
        with self._lock:
            now = self._clock()
            snaps = {sid: self._rank_snapshot(s, now) for sid, s in self._sessions.items()}
            processes = [(sid, s.process) for sid, s in self._sessions.items() if s.process is not None]
            by_key = {s.ref.key: s.id for s in self._sessions.values()}
            views = {dev.index: self._policy.view(dev.index) for dev in self.inventory.devices}
            held_back = {dev: [self._sessions[sid].ref.key for sid in sids] for dev, sids in self._deferred.items()}
            devices = {sid: s.ref.device for sid, s in self._sessions.items()}
        for sid, proc in processes:  # psutil reads /proc: keep it outside the lock
            try:
                with proc.oneshot():
                    cpu, rss = proc.cpu_percent(None), proc.memory_info().rss
                snaps[sid] = replace(snaps[sid], cpu_percent=cpu, rss_bytes=rss)
            except psutil.Error:
                pass
        out = {}
        for index, view in views.items():
            holders = [snaps[by_key[k]] for k in view.holders if k in by_key]
            waiting = [snaps[by_key[k]] for k in (*view.waiting, *held_back.get(index, ())) if k in by_key]
            seen = {by_key[k] for k in (*view.holders, *view.waiting, *held_back.get(index, ())) if k in by_key}
            others = [snaps[sid] for sid, d in devices.items() if d == index and sid not in seen]
            out[index] = DeviceSnapshot(holders, waiting, others, view.order)
        return out, list(snaps.values())

    # ---- internals -----------------------------------------------------

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}: register first (or it was evicted)") from None

    def _end_comm(self, sess: _Session, iteration: int, duration_s: float, now: float,
                  record: list[tuple[str, _Session, dict]]) -> None:
        measured = duration_s or (now - sess.phase_since if sess.phase is Phase.COMM else 0.0)
        sess.stats.comm_total += measured
        sess.stats.comm_n += 1
        self._policy.observe(sess.ref.key, "comm", measured, now)
        self._set_phase(sess, Phase.OTHER, now)
        record.append(("comm_end", sess, {"iteration": iteration, "duration_s": measured}))

    def _begin_comm(self, sess: _Session, iteration: int, now: float, record: list) -> None:
        self._set_phase(sess, Phase.COMM, now)
        record.append(("comm_begin", sess, {"iteration": iteration}))

    def _check_overdue(self, sess: _Session, now: float, record: list) -> None:
        """A holder far past its own compute time, with a rank waiting for the device, is treated as stalled.

        Defence in depth: the plugin frees the device around every Horovod wait, but a
        script can still block while holding (another library's collective, a lock).
        Then the next waiter is served instead of every waiter paying its grant timeout.
        """
        key = sess.ref.key
        if not self._policy.blocks or not self._policy.holds(key):
            return
        held = now - sess.phase_since
        ema = sess.stats.compute_ema
        limit = max(self.overdue_after_s, self.overdue_factor * ema if ema is not None else 0.0)
        if held <= limit or not self._policy.view(sess.ref.device).waiting:
            return
        self.overdue_total += 1
        record.append(("overdue", sess, {"held_s": held, "limit_s": limit, "iteration": sess.iteration}))
        _log.warning("%s rank %d has held device %d for %.2fs (limit %.2fs); treating it as stalled and "
                     "serving the next rank", sess.ident.job_name, sess.ident.rank, sess.ref.device, held, limit)
        sess.stats.compute_total += held
        self._set_phase(sess, Phase.OVERDUE, now)
        self._deliver(self._policy.release(key, now), now, record)

    def _suspend(self, sess: _Session, silent: float, now: float, record: list) -> None:
        was = sess.phase
        record.append(("suspend", sess, {"reason": f"no heartbeat for {silent:.2f}s", "phase": was.value}))
        if was is Phase.COMPUTE:
            record.append(("release", sess, {"reason": "suspended"}))
            sess.forgive_done = True
        self._set_phase(sess, Phase.SUSPENDED, now)
        sess.suspended_from = was
        self._deliver(self._policy.leave(sess.ref.key, now), now, record)
        self._forget_lease(sess, now, record)
        _log.warning("suspended %s rank %d: silent for %.2fs (its device is free; it resumes when it speaks again)",
                     sess.ident.job_name, sess.ident.rank, silent)

    def _resume(self, sess: _Session, silent: float, now: float, record: list) -> None:
        was, sess.suspended_from = sess.suspended_from, None
        self._set_phase(sess, Phase.OTHER, now)
        record.append(("resume", sess, {"silent_s": silent}))
        self._deliver(self._policy.join(sess.ref, now), now, record)
        if was is Phase.WAITING:  # it still waits for that grant: queue the request again, same turn
            self._queue_request(sess, sess.iteration, now, record)
        _log.info("resumed %s rank %d after %.2fs of silence", sess.ident.job_name, sess.ident.rank, silent)

    def _queue_request(self, sess: _Session, iteration: int, now: float, record: list) -> None:
        self._set_phase(sess, Phase.WAITING, now)
        record.append(("request", sess, {"iteration": iteration, "seq": sess.pending_seq, "turn": sess.turn}))
        if not self._defer(sess):
            self._hand_to_policy(sess, now, record)

    def _hand_to_policy(self, sess: _Session, now: float, record: list) -> None:
        """Queue the session's request; a rank that computes already (it did not wait: a lease,
        or a policy that did not block) holds its device at once, so nobody is granted beside it.

        Only a rank the daemon let compute unseen (its lease, or a lease being revoked) is
        taken at its word: any other request is queued, whatever it claims, so a client
        cannot make itself a second holder under a blocking policy.
        """
        device = sess.ref.device
        unseen = self._leases.get(device) == sess.id or sess.id in self._revoking.get(device, {})
        if sess.no_wait and self._policy.blocks and unseen:
            self._deliver(self._policy.occupy(sess.ref.key, sess.turn, now), now, record)
        else:
            self._deliver(self._policy.request(sess.ref.key, sess.turn, now), now, record)

    def _tell_share(self, device: int) -> None:
        """Tell each rank on the device how many others share it (they joined or left)."""
        on_device = [s for s in self._sessions.values() if s.ref.device == device]
        for sess in on_device:
            self._post(sess, ShareMsg(len(on_device) - 1))

    # ---- leases --------------------------------------------------------

    def _maybe_lease(self, sess: _Session, record: list) -> None:
        """Just granted: lease the device to the session if nobody else can want it."""
        device = sess.ref.device
        if (not self._lease_enabled or not sess.accepts_leases or device in self._leases
                or device in self._revoking or device in self._draining or not self._policy.blocks):
            return
        if any(s.ref.device == device for s in self._sessions.values() if s is not sess):
            return
        self._leases[device] = sess.id
        self._post(sess, LeaseMsg(True))
        record.append(("lease", sess, {}))

    def _revoke(self, device: int, reason: str, record: list) -> None:
        sid = self._leases.pop(device, None)
        if sid is None:
            return
        holder = self._sessions[sid]
        self._post(holder, LeaseMsg(False))
        self._await_release(holder, reason, record)

    def _await_release(self, sess: _Session, reason: str, record: list) -> None:
        """Hold back others' requests on the session's device until it says what it is doing."""
        self._revoking.setdefault(sess.ref.device, {})[sess.id] = self._clock()
        record.append(("lease_revoke", sess, {"reason": reason}))

    def _defer(self, sess: _Session) -> bool:
        """Hold a request back while another rank on its device may be computing unseen."""
        holders = self._revoking.get(sess.ref.device)
        if not holders or sess.id in holders:
            return False
        self._deferred.setdefault(sess.ref.device, {})[sess.id] = None
        return True

    def _end_revoke(self, device: int, holder: str, now: float, record: list) -> None:
        """The holder's requests are all known; once every holder's are, hand the held-back ones
        to the policy, in arrival order."""
        holders = self._revoking[device]
        del holders[holder]
        if holders:
            return
        del self._revoking[device]
        for sid in self._deferred.pop(device, {}):
            sess = self._sessions.get(sid)
            if sess is not None and sess.phase is Phase.WAITING and not self._policy.is_waiting(sess.ref.key):
                self._hand_to_policy(sess, now, record)

    def _forget_lease(self, sess: _Session, now: float, record: list) -> None:
        """The session left the policy (closed or suspended): its lease, or the wait for its release, ends."""
        device = sess.ref.device
        if self._leases.get(device) == sess.id:
            del self._leases[device]
            self._post(sess, LeaseMsg(False))  # a suspended rank reads it when it wakes, and waits for grants again
        if sess.id in self._revoking.get(device, {}):
            self._end_revoke(device, sess.id, now, record)
        deferred = self._deferred.get(device)
        if deferred is not None:
            deferred.pop(sess.id, None)

    def _set_phase(self, sess: _Session, phase: Phase, now: float) -> None:
        sess.phase = phase
        sess.phase_since = now

    def _finish_compute(self, sess: _Session, now: float, record: list, duration_s: float, strict: bool,
                        yields: bool = False) -> None:
        key = sess.ref.key
        held_back = self._deferred.get(sess.ref.device, {})
        if sess.phase is Phase.COMPUTE and self._policy.holds(key):
            held = now - sess.phase_since
            sess.stats.compute_total += held
            if yields:
                sess.yielded_s += duration_s or held
                record.append(("release", sess, {"held_s": held, "yields": True}))
            else:
                sess.stats.compute_n += 1
                phase_s = sess.yielded_s + (duration_s or held)
                ema = sess.stats.compute_ema
                sess.stats.compute_ema = phase_s if ema is None else 0.7 * ema + 0.3 * phase_s
                self._policy.observe(key, "compute", phase_s, now)
                sess.yielded_s = 0.0
                record.append(("release", sess, {"held_s": held}))
            self._set_phase(sess, Phase.OTHER, now)
            self._deliver(self._policy.release(key, now), now, record)
        elif sess.phase is Phase.WAITING and (self._policy.is_waiting(key) or sess.id in held_back):
            # The rank stopped waiting (grant timeout, or it never waits under a
            # non-blocking policy it still believed in): withdraw the request,
            # from the policy or from the requests held back for a lease.
            self._set_phase(sess, Phase.OTHER, now)
            record.append(("cancel", sess, {}))
            if sess.id in held_back:
                del held_back[sess.id]
            else:
                self._deliver(self._policy.cancel(key, now), now, record)
        elif sess.phase is Phase.OVERDUE:
            # Its device went to the next waiter while it overran (see `_check_overdue`): it is done now.
            self._set_phase(sess, Phase.OTHER, now)
            sess.yielded_s = 0.0
            record.append(("overdue_done", sess, {"late_s": now - sess.phase_since}))
        elif sess.phase is Phase.COMPUTE:
            # Computing since before a policy switch that held it back (a lease was
            # being revoked), so the new policy never had it: nothing to release there.
            held = now - sess.phase_since
            self._set_phase(sess, Phase.OTHER, now)
            record.append(("release", sess, {"held_s": held}))
        elif strict:
            raise FailedPrecondition(f"rank {key} reported compute done but holds no grant (phase {sess.phase.value})")

    def _deliver(self, keys: Iterable[RankKey], now: float, record: list | None = None) -> None:
        # Every policy call ends here: a good place to tell the timer a deadline may have appeared.
        if self._policy.next_deadline() is not None:
            self.deadline_changed.set()
        for key in keys:
            sess = self._by_key.get(key)
            if sess is None:
                continue
            if sess.phase is Phase.COMPUTE:
                continue
            waited = now - sess.requested_at
            sess.stats.waited_total += waited
            self._set_phase(sess, Phase.COMPUTE, now)
            if record is not None:
                record.append(("grant", sess, {"iteration": sess.iteration, "waited_s": waited}))
            # Nobody waits for the message under a policy that never blocks, or with a lease.
            if self._policy.blocks and not sess.no_wait:
                self._post(sess, GrantMsg(sess.pending_seq, sess.iteration, waited))
                self._maybe_lease(sess, record if record is not None else [])

    def _flush(self, record: list[tuple[str, _Session, dict]], now: float) -> None:
        # Called with the lock held, so the log's order is the order decisions were made
        # (tests and benchmarks check policies against it). One decision is one instant: its
        # entries are dated `now` (unless dated back), not by the log's clock as it writes them,
        # and never before their rank's previous entry; else a rank's next dated-back phase could
        # start before the end of its previous phase, logged a few microseconds late.
        for name, sess, fields in record:
            sess.last_t = fields["t"] = max(fields.get("t", now), sess.last_t)
            self._record(name, sess, **fields)
        record.clear()
        unsent, self._unsent = self._unsent, []
        for sess, msg in unsent:
            sess.send(msg)

    def _post(self, sess: _Session, msg: Any) -> None:
        """Send `msg` once the current decision is logged (`_flush`), so that no rank acts on
        a grant or lease before the event log shows it; called with the lock held."""
        self._unsent.append((sess, msg))

    def _record(self, event: str, sess: _Session, **fields) -> None:
        self.events.record(
            event,
            job=sess.ident.job_id,
            job_name=sess.ident.job_name,
            rank=sess.ident.rank,
            device=sess.ref.device,
            node=self.node,
            **fields,
        )

    def _rank_snapshot(self, s: _Session, now: float) -> RankSnapshot:
        st = s.stats
        alive = max(now - s.registered_at, 1e-9)
        waiting_now = now - s.requested_at if s.phase is Phase.WAITING else 0.0
        return RankSnapshot(
            ident=s.ident,
            phase=s.phase,
            iteration=s.iteration,
            mean_compute_s=st.compute_total / st.compute_n if st.compute_n else 0.0,
            mean_comm_s=st.comm_total / st.comm_n if st.comm_n else 0.0,
            wait_fraction=min(1.0, (st.waited_total + waiting_now) / alive),
            since_s=now - s.phase_since,
            registered_s=alive,
            cpu_percent=-1.0,
            rss_bytes=0,
        )


def _validate(ident: Identity, n_devices: int) -> None:
    if not ident.job_id or len(ident.job_id) > 128:
        raise InvalidRequest("job_id must be 1-128 characters")
    if len(ident.job_name) > 256:
        raise InvalidRequest("job_name is longer than 256 characters")
    if not 1 <= ident.world_size <= _MAX_WORLD:
        raise InvalidRequest(f"world_size={ident.world_size} is out of range 1..{_MAX_WORLD}")
    if not 0 <= ident.rank < ident.world_size:
        raise InvalidRequest(f"rank={ident.rank} is outside 0..world_size-1={ident.world_size - 1}")
    if not 0 <= ident.local_rank < max(ident.local_size, 1) or ident.local_size > ident.world_size:
        raise InvalidRequest(f"local_rank={ident.local_rank} / local_size={ident.local_size} are inconsistent")
    if ident.pid <= 0:
        raise InvalidRequest(f"pid={ident.pid} is not a process id")
    if ident.device >= n_devices or ident.device < -1:
        raise InvalidRequest(
            f"device={ident.device} does not exist (this node has {n_devices}; -1 lets the daemon choose)")
