"""A rank's session with its node's daemon, fail-open by construction.

When the daemon is absent, dies or stops answering, every call returns at once and training continues
unscheduled; a background thread re-attaches when it is back. A frozen daemon (SIGSTOP, swapped out) is
noticed by its unanswered heartbeats (`daemon_silence`). The first loss of contact is a warning, later ones INFO.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable

import grpc

from crossover.client.daemon_socket import channel_for
from crossover.client.rank.daemon_silence import Silence
from crossover.client.rank.device_memory import MemoryCaps
from crossover.client.rank.device_turns import DeviceTurns, TurnHandover
from crossover.client.rank.grant_waits import GrantWaits
from crossover.client.rank.late_reports import LateReports
from crossover.client.rank.traffic_class import TrafficMark
from crossover.client.rank.transport import SessionStream, StreamBroken, Unreachable, connect
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos.identity import RankIdentity
from crossover.protos.priority import name_of
from crossover.settings import PluginSettings

__all__ = ["Session"]

_log = logging.getLogger(__name__)
_FOLD_EVERY = 1024  # waits kept as a plain list before they go into the bounded record (one call per this many)


class Session:
    """Brackets a rank's phases for the daemon; never raises into training code."""

    def __init__(self, info: RankIdentity, settings: PluginSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.info = replace(info, pid=info.pid or os.getpid(), node=info.node or os.uname().nodename)
        self.settings = settings
        self._clock = clock
        self._cond = threading.Condition()
        self._seq = itertools.count(1)
        self._generation = 0
        self._attached = False
        self._blocks = False
        self._leased = False  # the daemon lets this rank compute without waiting for grants
        self._shares_device = True  # until the daemon says the rank is alone on its device
        self._last_send = 0.0
        self._unsent: tuple[pb.RankEvent, float] | None = None  # a request not sent on its own (see acquire)
        self._late = LateReports(settings.report_interval_s)  # iterations of a rank that does not wait, not yet sent
        self._granted_seq = 0
        self._stream: SessionStream | None = None
        self._requested_gen = -1  # generation in which a COMPUTE_REQUEST is outstanding
        self._warned = False
        self._cool_until = 0.0  # after a grant timeout: train unscheduled until then, then ask again
        self._silence = Silence(settings.daemon_silence_s)  # frozen: train unscheduled until it answers
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._receiver: threading.Thread | None = None
        self.registration: pb.RegisterResponse | None = None
        self.on_attach: Callable[[pb.RegisterResponse], None] | None = None
        self._grant_waits = GrantWaits()  # how long each blocking acquire took, bounded (`grant_waits`)
        self._unfolded: list[float] = []  # the latest waits, a plain list on the hot path, folded in 1024 at a time
        self.leased_acquires = 0  # how many of those returned at once under a lease
        self.transport = ""  # how the session stream travels: "session socket" or "grpc"
        self.job_class = ("normal", 1.0)  # this job's class on this node, as the daemon last said
        self.preempted = False  # a higher-class rank waits for this rank's device: yield at the next gradient
        self._outranked = False  # a rank of a higher class shares this rank's device, as the daemon last said
        self._traffic = TrafficMark(settings.low_dscp)  # the low class's DSCP on this rank's TCP sockets
        self.turns = TurnHandover()  # the hand-over on the device: pages, the device that uses them, tickets
        self._after = (0, 0)  # the latest grant's page and ticket to wait for on the device
        self._device_handover = False  # every rank on this device ends its turns on the device
        self.memory = MemoryCaps(self.info.job_name, self._report_cap_hit)  # the daemon's memory cap, applied
        self._iteration = 0  # the latest iteration it asked for the device in
        self._thread = threading.Thread(target=self._run, name="crossover-session", daemon=True)

    # ---- phase calls (made from the training thread) --------------------

    @property
    def grant_waits(self) -> GrantWaits:
        """How long each blocking acquire waited (benchmarks and the stats file read it)."""
        self._fold_waits()
        return self._grant_waits

    def _fold_waits(self) -> None:
        waits, self._unfolded = self._unfolded, []
        self._grant_waits.add_many(waits)

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def shares_device(self) -> bool:
        """Another rank is registered on this rank's device, as far as the daemon last said
        (True while that is unknown: detached, or a daemon that does not say)."""
        return self._shares_device

    def acquire(self, iteration: int, comm_s: float | None = None) -> bool:
        """Ask for the device; block until granted when the policy gates. True when scheduled.

        ``comm_s``: the allreduce that just ended, folded into the request (one
        message instead of a COMM_END and a COMPUTE_REQUEST back to back). A request
        nobody waits for (policy that does not block, or a lease) is sent with the release,
        and such iterations are reported a few at a time (CROSSOVER_REPORT_INTERVAL).
        """
        if self.turns.attach_pending():  # a turn page arrived since: this thread maps it on the device
            self._say_ready()
        self._iteration = iteration
        with self._cond:
            if not self._attached:
                return False
            # In a cool-off, a frozen daemon, or already asked: nothing to request, only the
            # allreduce's end to report.
            if self._clock() < self._cool_until or self._silence.frozen or self._requested_gen == self._generation:
                if comm_s is not None:
                    self._send(pb.RankEvent(kind=pb.COMM_END, iteration=iteration - 1, duration_s=comm_s))
                return False
            start = self._clock()
            seq = next(self._seq)
            gen = self._generation
            self._requested_gen = gen
            request = pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=iteration, seq=seq,
                                   duration_s=comm_s or 0.0)
            if not self._blocks or self._leased:
                # Nobody answers a request the rank does not wait for: it rides on the release
                # (one message per iteration), or goes first if the daemon must know sooner.
                self._unsent = (request, start)
                if self._blocks:
                    self.leased_acquires += 1
                    self._unfolded.append(self._clock() - start)
                    if len(self._unfolded) >= _FOLD_EVERY:
                        self._fold_waits()
                return True
            self._send(request)
            deadline = start + self.settings.grant_timeout_s
            while self._granted_seq < seq and self._attached and self._generation == gen and self._blocks:
                if self._silence.frozen:
                    return False
                left = deadline - self._clock()
                if left <= 0:
                    cool = self.settings.cool_off_s
                    self._cool_until = self._clock() + cool
                    _log.warning("no grant after %.1fs (iteration %d); training unscheduled for %.0fs, then "
                                 "asking again", self.settings.grant_timeout_s, iteration, cool)
                    return False
                self._cond.wait(left)
            self._unfolded.append(self._clock() - start)
            if len(self._unfolded) >= _FOLD_EVERY:
                self._fold_waits()
            granted = self._granted_seq >= seq
            after, self._after = self._after, (0, 0)
        if granted and after[0]:
            self.turns.wait_after(*after)
        return granted

    @property
    def outranked(self) -> bool:
        """A rank of a higher class shares this rank's device (as the daemon last said) and this rank waits for
        grants, so it may be asked to yield mid-phase: under passthrough or a lease nobody asks."""
        return self._outranked and self._attached and self._blocks and not self._leased

    @property
    def hands_over(self) -> bool:
        """Whether this rank's turns end on its device now: it waits for grants and every rank there can."""
        return self._attached and self._blocks and not self._leased and self._device_handover and self.turns.ready

    def end_turn(self) -> int:
        """Queue this turn's ticket behind its work on the device; the ticket, for `release`."""
        return self.turns.end_turn()

    def use_device(self, device: DeviceTurns) -> None:
        """The rank's device can wait on turn pages and store into them (see `device_turns`); nothing with
        CROSSOVER_HANDOVER=0."""
        if self.settings.handover and self.turns.use(device):
            self._say_ready()

    def _report_cap_hit(self, asked: int) -> None:
        with self._cond:
            if self._attached:
                self._send(pb.RankEvent(kind=pb.MEMORY_CAP_HIT, iteration=self._iteration, memory_bytes=asked))

    def _say_ready(self) -> None:
        with self._cond:
            if self._attached:
                self._send(pb.RankEvent(kind=pb.HANDOVER_READY))

    def release(self, iteration: int, duration_s: float = 0.0, comm_begins: bool = False,
                yields: bool = False, ticket: int = 0) -> None:
        """The device work of this iteration is complete (and, with ``comm_begins``, its allreduce starts).

        With ``yields`` the phase is not over: the rank hands the device back while it waits
        for other ranks, and asks again with the same iteration afterwards. With a ``ticket``
        (`end_turn`) the work is queued, not done: the device stores the ticket when it is.
        """
        with self._cond:
            if self._attached and self._requested_gen == self._generation:
                self._requested_gen = -1
                self._send_done(iteration, duration_s, comm_begins, yields, ticket)

    def comm_begin(self, iteration: int) -> None:
        with self._cond:
            if self._attached:
                self._requested_gen = -1  # entering comm implicitly releases
                if self._unsent is not None:
                    self._send_done(iteration, 0.0, comm_begins=True)
                else:
                    self._send(pb.RankEvent(kind=pb.COMM_BEGIN, iteration=iteration))

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> Session:
        """Try to attach now (bounded by CROSSOVER_CONNECT_TIMEOUT), then keep trying in the background."""
        self._attach()
        self._thread.start()
        return self

    def close(self, drain_timeout_s: float = 2.0) -> None:
        """End the session. The stream is half-closed first and given a bounded time to
        deliver the events still queued (closing the channel at once would drop them)."""
        self._stop.set()
        with self._cond:
            stream = self._stream
            self._detach_locked()
            receiver = self._receiver
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(drain_timeout_s)
        if stream is not None:
            stream.dispose()
        if self._channel is not None:
            self._channel.close()

    # ---- internals -------------------------------------------------------

    def _send_done(self, iteration: int, duration_s: float, comm_begins: bool, yields: bool = False,
                   ticket: int = 0) -> None:
        if self._unsent is None:
            self._send(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=iteration, duration_s=duration_s,
                                    comm_begins=comm_begins, yields=yields, handover_ticket=ticket))
            return
        request, start = self._unsent
        self._unsent = None
        now = self._clock()
        done = pb.RankEvent(kind=pb.COMPUTE_DONE, requested=True, iteration=request.iteration, seq=request.seq,
                            comm_s=request.duration_s, duration_s=duration_s or now - start, comm_begins=comm_begins,
                            yields=yields)
        if self._late.hold(done, now):
            self._flush_batch()

    def _flush_batch(self) -> None:
        """Send the iterations reported late, each dated by how long ago it happened."""
        batch = self._late.take(self._clock())
        if batch is not None:
            self._put(batch)

    def _send_unsent(self) -> None:
        """The daemon must know now that this rank computes (a lease revoked, a policy that blocks)."""
        if self._unsent is not None:
            request, _ = self._unsent
            self._unsent = None
            request.no_wait = True
            self._send(request)

    def _answer_release(self) -> None:
        """LEASE_RELEASED, after every request this rank computes under: the daemon relies on that order."""
        self._send_unsent()
        self._send(pb.RankEvent(kind=pb.LEASE_RELEASED))

    def _send(self, event: pb.RankEvent) -> None:
        self._flush_batch()  # the daemon must see events in the order they happened
        self._put(event)

    def _put(self, event: pb.RankEvent) -> None:
        if self._stream is not None:
            try:
                self._stream.send(event)
            except StreamBroken as exc:  # the receiving thread sees the end too and detaches
                _log.info("%s", exc)
            self._last_send = self._clock()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._attached:
                interval = self.registration.heartbeat_interval_s if self.registration else 0.2
                if self._stop.wait(interval):
                    return
                with self._cond:
                    # Any event proves the rank alive: a heartbeat only fills a silence
                    # (at most two intervals long, well inside the daemon's timeout).
                    if self._attached and self._late:
                        self._flush_batch()
                    elif self._attached and self._clock() - self._last_send >= interval:
                        self._send(pb.RankEvent(kind=pb.HEARTBEAT))
                        self._silence.sent(self._clock())
                    self._check_silence()
            else:
                if self._stop.wait(self.settings.reconnect_interval_s):
                    return
                self._attach()

    def _check_silence(self) -> None:
        """Take the daemon for frozen once a heartbeat went unanswered for CROSSOVER_DAEMON_SILENCE."""
        silent = self._silence.check(self._clock()) if self._attached else 0.0
        if silent:
            _log.warning("crossoverd has not answered a heartbeat for %.1fs; training unscheduled until it "
                         "answers again", silent)
            self._cond.notify_all()

    def _attach(self) -> None:
        s = self.settings
        if self._channel is None:
            self._channel, self._metadata = channel_for(s.target, s.token, s.tls_ca)
        try:
            reg, stream = connect(s, self.info.to_pb(), self._channel, self._metadata)
        except Unreachable as exc:
            self._lost(exc.why, exc.then)
            return
        with self._cond:
            self._generation += 1
            self._stream = stream
            self.transport = stream.name
            self._attached = True
            self._blocks = reg.policy_blocks
            self._leased = False
            self._unsent = None
            self._granted_seq = 0
            self._silence.reset()
            self.registration = reg
        receiver = threading.Thread(target=self._receive, args=(stream, self._generation),
                                    name="crossover-recv", daemon=True)
        with self._cond:
            self._receiver = receiver
        receiver.start()
        if self._warned:
            _log.warning("re-attached to crossoverd at %s (session %s); training is scheduled again",
                         s.target, reg.session_id[:8])
        else:
            _log.info("attached to crossoverd at %s: node %s device %d policy %s, stream over %s",
                      s.target, reg.node, reg.device, reg.policy, stream.name)
        if self.on_attach is not None:
            try:
                self.on_attach(reg)
            except Exception:  # a failing callback must not break training
                _log.exception("on_attach callback failed")

    def _receive(self, stream: SessionStream, gen: int) -> None:
        reason = "daemon closed the session"
        try:
            for d in stream.receive():
                with self._cond:
                    if self._silence.heard():
                        _log.warning("crossoverd answers again; training is scheduled again")
                    if d.HasField("alive"):
                        self._silence.answers = True
                    elif d.HasField("grant"):
                        self._granted_seq = max(self._granted_seq, d.grant.seq)
                        self._after = (d.grant.after_page, d.grant.after_ticket)
                    elif d.HasField("lease"):
                        self._leased = d.lease.held
                        if not d.lease.held:
                            self._answer_release()
                    elif d.HasField("share"):
                        self._shares_device = d.share.other_ranks > 0
                        self._device_handover = d.share.handover
                        self._outranked = d.share.outranked
                        self.memory.told(d.share.memory_cap_bytes if d.share.HasField("memory_cap_bytes") else None,
                                         d.share.memory_cap_why, self.registration.device if self.registration else -1)
                    elif d.HasField("handover_page"):
                        self.turns.page(d.handover_page.page, d.handover_page.own, stream.take_fd())
                    elif d.HasField("job_class"):
                        self._job_class(d.job_class)
                    elif d.HasField("preempt"):
                        self.preempted = True
                    elif d.HasField("policy"):
                        was_blocking, self._blocks = self._blocks, d.policy.policy_blocks
                        if self._blocks and not was_blocking:  # the daemon waits for this, as for a lease
                            self._answer_release()
                        _log.info("daemon switched policy to %s", d.policy.policy)
                    self._cond.notify_all()
        except StreamBroken as exc:
            reason = str(exc)
        with self._cond:
            if self._generation == gen and self._attached:
                self._detach_locked()
                if not self._stop.is_set():
                    self._lost(f"lost crossoverd ({reason})")

    def _job_class(self, update: pb.JobClassUpdate) -> None:
        """The job's class on this node changed (or a class the rank asked for was refused: one line, once)."""
        name = name_of(update.priority) or "normal"
        self.job_class = (name, update.weight)
        self._traffic.follow(name)
        if update.note:
            _log.warning("crossover: %s", update.note)
        else:
            _log.info("crossover: this job runs as %s%s on %s", name,
                      "" if update.weight == 1.0 else f" (weight {update.weight:g})", self.info.node)

    def take_preempted(self) -> bool:
        """Whether a higher-class rank asked for this rank's device since the last call (then it yields)."""
        with self._cond:
            asked, self.preempted = self.preempted, False
            return asked

    def _detach_locked(self) -> None:
        self._attached = False
        self._leased = False
        self._shares_device = True
        self._device_handover = False
        self._outranked = False
        self._after = (0, 0)
        self.turns.close()
        self._unsent = None
        self._requested_gen = -1
        self._flush_batch()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._cond.notify_all()

    def _lost(self, why: str, then: str = "") -> None:
        then = then or "re-attaches when the daemon is back"
        if not self._warned:
            self._warned = True
            _log.warning("%s; training continues unscheduled and %s", why, then)
        else:
            _log.info("%s", why)
