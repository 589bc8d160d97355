"""Leases: a job alone on its device computes without waiting for each grant.

The ranks of one job alone on their device under a blocking policy would be
granted every request at once (a job's ranks on one device compute together,
`DeviceQueues.mates`), so each is given a lease: it keeps reporting its phases
but stops waiting for each grant (a round trip per iteration saved). The lease
is revoked when another rank joins the device, on a drain or a policy switch.
Until the holder confirms (LEASE_RELEASED, which follows every request it made
under the lease on its stream), other ranks' requests on that device are held
back from the policy, so the policy never grants the device while the holder
might be computing unseen.

A device where grants do not pay (`grant_payoff`) is *opened*: every rank on it,
whatever its job, holds a lease, so it trains as if unscheduled, until the
device is closed again (a revoke, as above).

`Leases` keeps these rules' state; the scheduler calls it under its lock and
hands the requests it releases to the policy.
"""
from __future__ import annotations

from typing import Callable

from crossover.daemon.api import RankKey
from crossover.daemon.events import Decision
from crossover.daemon.messages import LeaseMsg
from crossover.daemon.registry import Registry, Session
from crossover.protos.event_records import Lease, LeaseRevoke

__all__ = ["Leases"]


class Leases:
    """Which device is leased to whom, whose release is awaited, and the requests held back meanwhile."""

    def __init__(self, enabled: bool, registry: Registry, clock: Callable[[], float]) -> None:
        self.enabled = enabled
        self._registry = registry
        self._clock = clock
        self._held: dict[int, dict[str, None]] = {}  # device -> the sessions holding its lease, in order
        self._revoking: dict[int, dict[str, float]] = {}  # device -> {session whose LEASE_RELEASED is awaited: since}
        self._deferred: dict[int, dict[str, None]] = {}  # device -> sessions whose request waits for it
        self.draining: set[int] = set()  # devices that take no new ranks and give no leases
        self.opened: set[int] = set()  # devices leased to every rank on them (grants do not pay there)
        self.closed_at: dict[int, float] = {}  # device -> when it was last closed (grants came back)

    def offer(self, sess: Session, d: Decision) -> None:
        """Just granted under a blocking policy: lease the device to the session if no other job can want it."""
        device = sess.ref.device
        held = self._held.get(device, {})
        if (not self.enabled or not sess.accepts_leases or sess.id in held
                or device in self._revoking or device in self.draining):
            return
        if device not in self.opened and any(s.ref.key.job_id != sess.ref.key.job_id
                                             for s in self._registry.on_device(device)):
            return
        self._give(sess, d)

    def leased_devices(self) -> list[int]:
        return list(self._held)

    def can_open(self, device: int) -> bool:
        """Nothing stands in the way of opening the device: leases on, no drain, no release awaited."""
        return self.enabled and device not in self.draining and device not in self._revoking

    def open(self, device: int, d: Decision) -> None:
        """Lease the device to every rank on it that takes leases, now and as each is next granted."""
        self.opened.add(device)
        for sess in self._registry.on_device(device):
            if sess.accepts_leases and sess.id not in self._held.get(device, {}):
                self._give(sess, d, opened=True)

    def _give(self, sess: Session, d: Decision, opened: bool = False) -> None:
        self._held.setdefault(sess.ref.device, {})[sess.id] = None
        d.post(sess, LeaseMsg(True))
        d.log(sess, Lease(opened=opened))

    def revoke(self, device: int, reason: str, d: Decision) -> None:
        """Take the device's lease back, if it has one, and await each holder's release; an open
        device is closed."""
        if device in self.opened:
            self.opened.discard(device)
            self.closed_at[device] = self._clock()
        for sid in self._held.pop(device, {}):
            holder = self._registry.get(sid)
            d.post(holder, LeaseMsg(False))
            self.await_release(holder, reason, d)

    def await_release(self, sess: Session, reason: str, d: Decision) -> None:
        """Hold back others' requests on the session's device until it says what it is doing."""
        self._revoking.setdefault(sess.ref.device, {})[sess.id] = self._clock()
        d.log(sess, LeaseRevoke(reason=reason))

    def awaits_release(self, sess: Session) -> bool:
        return sess.id in self._revoking.get(sess.ref.device, {})

    def computes_unseen(self, sess: Session) -> bool:
        """The daemon let the session compute without a grant: it holds the lease, or is giving it up."""
        return sess.id in self._held.get(sess.ref.device, {}) or self.awaits_release(sess)

    def defer(self, sess: Session) -> bool:
        """Hold a request back while another rank on its device may be computing unseen."""
        holders = self._revoking.get(sess.ref.device)
        if not holders or sess.id in holders:
            return False
        self._deferred.setdefault(sess.ref.device, {})[sess.id] = None
        return True

    def is_held_back(self, sess: Session) -> bool:
        return sess.id in self._deferred.get(sess.ref.device, {})

    def withdraw(self, sess: Session) -> None:
        """Drop the session's held-back request (it stopped waiting)."""
        del self._deferred[sess.ref.device][sess.id]

    def released(self, device: int, holder: str) -> list[str]:
        """The holder's requests are all known. Once every holder's are: the held-back sessions,
        in arrival order, for the policy; until then, none."""
        holders = self._revoking[device]
        del holders[holder]
        if holders:
            return []
        del self._revoking[device]
        return list(self._deferred.pop(device, {}))

    def forget(self, sess: Session, d: Decision) -> list[str]:
        """The session left the policy (closed or suspended): its lease, or the wait for its release,
        ends. Returns the held-back sessions that may go to the policy now (see `released`)."""
        device = sess.ref.device
        held = self._held.get(device, {})
        if sess.id in held:
            del held[sess.id]
            if not held:
                del self._held[device]
            d.post(sess, LeaseMsg(False))  # a suspended rank reads it when it wakes, and waits for grants again
        freed = self.released(device, sess.id) if self.awaits_release(sess) else []
        deferred = self._deferred.get(device)
        if deferred is not None:
            deferred.pop(sess.id, None)
        return freed

    def unanswered(self, now: float, timeout_s: float) -> list[tuple[int, str]]:
        """(device, session) of every holder whose release is awaited for longer than `timeout_s`."""
        return [(device, sid) for device, holders in self._revoking.items()
                for sid, since in holders.items() if now - since > timeout_s]

    def held_back(self) -> dict[int, list[RankKey]]:
        """Per device, the ranks whose requests are held back, in arrival order."""
        return {dev: [self._registry.get(sid).ref.key for sid in sids] for dev, sids in self._deferred.items()}
