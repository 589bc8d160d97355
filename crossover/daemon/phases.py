"""A rank's phase changes and the policy calls each one makes (see `api.Phase` for the transitions).

`PhaseMachine` applies one `RankEvent` to a session: it moves the session's
phase, asks the policy, logs each step in the decision and posts the grants
the policy hands out. It runs under the scheduler's lock and reads no clock:
every step is dated by the `now` it is given.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable

from crossover.daemon.api import FailedPrecondition, Phase, Policy, RankKey
from crossover.daemon.events import Decision, EventKind, RankEvent
from crossover.daemon.handover import Pages
from crossover.daemon.leases import Leases
from crossover.daemon.messages import AliveMsg, GrantMsg, PageMsg, ShareMsg
from crossover.daemon.policies.memory import MemoryCap
from crossover.daemon.registry import Registry, Session
from crossover.figures import format_bytes
from crossover.protos import event_records
from crossover.protos.event_records import (
    Cancel,
    CommBegin,
    CommEnd,
    Grant,
    Handover,
    LeaseReleased,
    MemoryCapHit,
    OverdueDone,
    Release,
    Request,
)

__all__ = ["PhaseMachine"]


class PhaseMachine:
    """The rank state machine of one node, over its registry, its leases and its policy.

    Who holds a device is read from the policy (`Policy.holds`, `Policy.view`), the
    one record of grants; a session's `phase` says what the rank does, which can be
    computing without a grant (see `Session`).
    """

    def __init__(self, policy: Policy, registry: Registry, leases: Leases, pages: Pages | None = None) -> None:
        self.policy = policy
        self.deadline_changed = threading.Event()
        self.pages = pages  # None: no hand-over on the device here (see `handover`)
        self.handover_on = pages is not None  # the operator's switch (`crossover policy --handover`)
        # Priorities fit a lower job's turns into a higher one's gaps by their device time, which a turn
        # ended on the device hides from the daemon: where jobs' classes differ, turns end on the CPU.
        self.classes_differ: Callable[[int], bool] = lambda device: False
        self.priority_of: Callable[[str], int] = lambda job: 0  # a job's class as a number; larger goes first
        # Each job's memory cap on a device, given the sessions there (`policies.memory`); none by default.
        self.caps_on: Callable[[int, list[Session]], dict[str, MemoryCap]] = lambda device, on: {}
        self._registry = registry
        self._leases = leases
        self._owed: dict[int, str] = {}  # device -> the session that released it last, its ticket still owed

    def apply(self, sess: Session, ev: RankEvent, now: float, d: Decision) -> None:
        """One event of the session, dated `now` (never before `sess.last_t`, its latest logged entry)."""
        kind = ev.kind
        if kind is EventKind.HEARTBEAT:
            d.post(sess, AliveMsg())
        elif kind is EventKind.COMPUTE_REQUEST:
            self._request(sess, ev.iteration, ev.seq, ev.duration_s, ev.no_wait, now, d)
        elif kind is EventKind.COMPUTE_DONE:
            if ev.requested:  # its request rode along: apply it first, dated when the phase began
                began = max(now - ev.duration_s, sess.last_t, sess.floor_t)
                mark = d.mark()
                self._request(sess, ev.iteration, ev.seq, ev.comm_s, True, now, d)
                d.date_since(mark, began)
                sess.requested_at = began
                if sess.phase is Phase.COMPUTE:
                    sess.phase_since = began
            self.finish_compute(sess, now, d, ev.duration_s, strict=not sess.forgive_done, yields=ev.yields,
                                ticket=ev.handover_ticket)
            sess.forgive_done = False
            if ev.comm_begins:
                self._begin_comm(sess, ev.iteration, now, d)
        elif kind is EventKind.COMM_BEGIN:
            if sess.phase in (Phase.COMPUTE, Phase.WAITING, Phase.OVERDUE):
                self.finish_compute(sess, now, d, 0.0, strict=False)
            self._begin_comm(sess, ev.iteration, now, d)
        elif kind is EventKind.COMM_END:
            self._end_comm(sess, ev.iteration, ev.duration_s, now, d)
        elif kind is EventKind.LEASE_RELEASED and self._leases.awaits_release(sess):
            d.log(sess, LeaseReleased())
            self.end_revoke(sess.ref.device, sess.id, now, d)
        elif kind is EventKind.HANDOVER_READY:
            self._handover_ready(sess, d)
        elif kind is EventKind.MEMORY_CAP_HIT:
            self._cap_hit(sess, ev.iteration, ev.memory_bytes, d)

    @staticmethod
    def _cap_hit(sess: Session, iteration: int, asked: int, d: Decision) -> None:
        """The rank's allocator refused an allocation at its cap: kept for `crossover jobs`, and logged."""
        cap = sess.memory_cap
        if cap.limit is None:
            return  # a cap lifted since: the rank ran out of the device itself, not of a cap
        more = f", asking for {format_bytes(asked)} more" if asked else ""
        sess.memory_note = f"out of its memory cap at iteration {iteration}{more}: it may hold {cap.why}"
        d.log(sess, MemoryCapHit(iteration=iteration, asked_bytes=asked, cap_bytes=cap.limit))

    def _handover_ready(self, sess: Session, d: Decision) -> None:
        """The rank's device waits on pages and stores tickets: it may end its turns there."""
        if self.pages is None or sess.handover or not self.pages.seal(sess.id):
            return
        sess.handover = "device"
        d.log(sess, Handover(path=sess.handover))
        self.tell_share(sess.ref.device, d)

    def _request(self, sess: Session, iteration: int, seq: int, comm_s: float, no_wait: bool,
                 now: float, d: Decision) -> None:
        if sess.phase in (Phase.WAITING, Phase.COMPUTE):
            raise FailedPrecondition(f"rank {sess.ref.key} requested the device while in phase {sess.phase.value}")
        if sess.phase is Phase.COMM:  # the request carries the end of the allreduce before it
            self._end_comm(sess, iteration - 1, comm_s, now, d)
        sess.iteration = max(sess.iteration, iteration)
        sess.pending_seq = seq
        sess.requested_at = now
        sess.pending_iteration = iteration
        sess.forgive_done = False
        sess.no_wait = no_wait
        self.queue_request(sess, iteration, now, d)

    def queue_request(self, sess: Session, iteration: int, now: float, d: Decision) -> None:
        sess.set_phase(Phase.WAITING, now)
        d.log(sess, Request(iteration=iteration, seq=sess.pending_seq))
        if not self._leases.defer(sess):
            self._hand_to_policy(sess, now, d)

    def _hand_to_policy(self, sess: Session, now: float, d: Decision) -> None:
        """Queue the session's request; a rank that computes already (it did not wait: a lease,
        or a policy that did not block) holds its device at once, so nobody is granted beside it.

        Only a rank the daemon let compute unseen (its lease, or a lease being revoked) is
        taken at its word: any other request is queued, whatever it claims, so a client
        cannot make itself a second holder under a blocking policy.
        """
        if sess.no_wait and self.policy.blocks and self._leases.computes_unseen(sess):
            self.deliver(self.policy.occupy(sess.ref.key, sess.pending_iteration, now), now, d)
        else:
            self.deliver(self.policy.request(sess.ref.key, sess.pending_iteration, now), now, d)

    def _begin_comm(self, sess: Session, iteration: int, now: float, d: Decision) -> None:
        sess.set_phase(Phase.COMM, now)
        d.log(sess, CommBegin(iteration=iteration))

    def _end_comm(self, sess: Session, iteration: int, duration_s: float, now: float, d: Decision) -> None:
        # As for compute: the rank's figure within what the daemon saw (no allreduce began before the
        # rank's current phase did); without one, the daemon's own measure of a COMM phase.
        seen = max(0.0, now - sess.phase_since)
        measured = min(duration_s, seen) if duration_s > 0 else (seen if sess.phase is Phase.COMM else 0.0)
        sess.stats.comm_total += measured
        sess.stats.comm_n += 1
        if self._fits_estimates(sess):
            self.policy.observe(sess.ref.key, "comm", measured, now)
        sess.set_phase(Phase.OTHER, now)
        d.log(sess, CommEnd(iteration=iteration, duration_s=measured))

    def _fits_estimates(self, sess: Session) -> bool:
        """Whether the rank's ending phase tells the policy what its phases take under grants: not if it
        began on a device opened because grants do not pay there, where every job's phases ran beside the
        others' (the probes of `--adapt` open it for windows at a time, and a lower job's compute measured
        there would not fit the gaps it gets under grants)."""
        device = sess.ref.device
        return device not in self._leases.opened and sess.phase_since >= self._leases.closed_at.get(device, 0.0)

    def finish_compute(self, sess: Session, now: float, d: Decision, duration_s: float, strict: bool,
                       yields: bool = False, ticket: int = 0) -> None:
        """The rank's compute phase ended (or it stopped waiting for one); `strict`: a rank that
        neither computes nor waits is an error. `ticket`: the rank released before its device
        finished, which stores the ticket in its page when it has (the next holder waits for that)."""
        key = sess.ref.key
        if sess.phase is Phase.COMPUTE and self.policy.holds(key):
            held = now - sess.phase_since
            sess.stats.compute_total += held
            # The rank's own figure may refine the daemon's (it excludes the grant's trip), never
            # lengthen it: the liveness limit and the policy's estimates follow this figure.
            measured = min(duration_s, held) if duration_s > 0 else held
            if yields:
                sess.yielded_s += measured
                d.log(sess, Release(held_s=held, yields=True))
            else:
                sess.stats.compute_n += 1
                phase_s = sess.yielded_s + measured
                ema = sess.stats.compute_ema
                sess.stats.compute_ema = phase_s if ema is None else 0.7 * ema + 0.3 * phase_s
                if self._fits_estimates(sess):
                    self.policy.observe(key, "compute", phase_s, now)
                sess.yielded_s = 0.0
                d.log(sess, Release(held_s=held))
            sess.set_phase(Phase.OTHER, now)
            # Only a sealed page's ticket is owed (see `_handover_ready`): no other rank gets an unsealed one.
            if ticket and sess.handover == "device" and self.pages is not None \
                    and self.pages.released(sess.id, ticket, now) is not None:
                self._owed[sess.ref.device] = sess.id
            self.deliver(self.policy.release(key, now), now, d)
        elif sess.phase is Phase.WAITING and ((held_back := self._leases.is_held_back(sess))
                                              or self.policy.is_waiting(key)):
            # The rank stopped waiting (grant timeout, or it never waits under a
            # non-blocking policy it still believed in): withdraw the request,
            # from the policy or from the requests held back for a lease.
            sess.set_phase(Phase.OTHER, now)
            d.log(sess, Cancel())
            if held_back:
                self._leases.withdraw(sess)
            else:
                self.deliver(self.policy.cancel(key, now), now, d)
        elif sess.phase is Phase.OVERDUE:
            # Its device went to the next waiter while it overran (see `Liveness`): it is done now.
            sess.set_phase(Phase.OTHER, now)
            sess.yielded_s = 0.0
            d.log(sess, OverdueDone(late_s=now - sess.phase_since))
        elif sess.phase is Phase.COMPUTE:
            # Computing since before a policy switch that held it back (a lease was
            # being revoked), so the new policy never had it: nothing to release there.
            held = now - sess.phase_since
            sess.set_phase(Phase.OTHER, now)
            d.log(sess, Release(held_s=held))
        elif strict:
            raise FailedPrecondition(f"rank {key} reported compute done but holds no grant (phase {sess.phase.value})")

    def deliver(self, keys: Iterable[RankKey], now: float, d: Decision) -> None:
        """Every policy call's grants end here: each granted rank computes from `now`."""
        if self.policy.next_deadline() is not None:  # a deadline may have appeared: wake the timer
            self.deadline_changed.set()
        for key in keys:
            sess = self._registry.by_key(key)
            if sess is None or sess.phase is Phase.COMPUTE:
                continue
            waited = now - sess.requested_at
            sess.stats.waited_total += waited
            sess.set_phase(Phase.COMPUTE, now)
            # Nobody waits for the message under a policy that never blocks, or with a lease.
            told = self.policy.blocks and not sess.no_wait
            page, ticket = self._after(sess, d) if told else (0, 0)
            d.log(sess, Grant(iteration=sess.iteration, waited_s=waited, after=ticket))
            if told:
                d.post(sess, GrantMsg(sess.pending_seq, sess.iteration, waited, page, ticket))
                self._leases.offer(sess, d)

    def _after(self, sess: Session, d: Decision) -> tuple[int, int]:
        """The page and ticket the granted rank's device must wait for: its device's last holder's, while that
        holder's device still owes it; (0, 0) when nothing is owed or the rank does not hand over on its device.
        The rank gets a read-only descriptor of the page before its first grant that names it."""
        owner = self._owed.get(sess.ref.device)
        if self.pages is None or not self.handover_on or sess.handover != "device" or owner is None \
                or owner == sess.id:
            return 0, 0
        page = self.pages.of(owner)
        if page is None or not page.owes:
            return 0, 0
        if page.id not in sess.pages_sent:
            sess.pages_sent.add(page.id)
            d.post(sess, PageMsg(page.id, page.ro_fd, own=False))
        return page.id, page.owed

    def end_revoke(self, device: int, holder: str, now: float, d: Decision) -> None:
        """The holder's requests are all known: hand the held-back ones to the policy (see `Leases.released`)."""
        self._hand_released(self._leases.released(device, holder), now, d)

    def forget_lease(self, sess: Session, now: float, d: Decision) -> None:
        """The session left the policy: its lease ends, and requests held back for it go on."""
        self._hand_released(self._leases.forget(sess, d), now, d)

    def _hand_released(self, session_ids: list[str], now: float, d: Decision) -> None:
        for sid in session_ids:
            sess = self._registry.find(sid)
            if sess is not None and sess.phase is Phase.WAITING and not self.policy.is_waiting(sess.ref.key):
                self._hand_to_policy(sess, now, d)

    def tell_share(self, device: int, d: Decision) -> None:
        """Tell each rank on the device how many others share it (they joined or left), whether every
        rank there ends its turns on the device, whether a rank of a higher class is there, and what it
        may hold of the device's memory (its job's cap, split among the job's ranks there)."""
        on_device = self._registry.on_device(device)
        handover = (self.pages is not None and self.handover_on and not self.classes_differ(device)
                    and all(s.handover == "device" for s in on_device))
        top = max((self.priority_of(s.ref.key.job_id) for s in on_device), default=0)
        caps = self.caps_on(device, on_device)
        ranks = Counter(s.ref.key.job_id for s in on_device)
        for sess in on_device:
            job = sess.ref.key.job_id
            cap = caps.get(job, MemoryCap())
            if cap.limit is not None and ranks[job] > 1:
                each = cap.limit // ranks[job]
                cap = MemoryCap(each, f"{cap.why}; its {ranks[job]} ranks here share that, {format_bytes(each)} each")
            if cap != sess.memory_cap:
                sess.memory_cap = cap
                d.log(sess, event_records.MemoryCap(cap_bytes=cap.limit, why=cap.why))
            d.post(sess, ShareMsg(len(on_device) - 1, handover, self.priority_of(job) < top, cap))
