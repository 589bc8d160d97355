"""Liveness: ranks that fall silent, die, or hold their device far too long.

A rank silent past the heartbeat timeout is suspended: its device is freed
at once but its session is kept, so a rank that was only starved of CPU for a
moment (a loaded node) carries on where it was when it speaks again, instead of
training unscheduled until it re-registers. A rank silent past the eviction
time, whose process is gone, or that never opened its stream is evicted.
A holder far past its own compute time, with a rank waiting, is treated as
stalled (`OVERDUE`) and the device goes to the next rank. Its compute time is
what the daemon saw (a rank's own figure may only shorten it), and no holder
keeps a device past `max_hold_s` while another rank waits, whatever it reports.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from crossover.daemon.api import InvalidRequest, Phase
from crossover.daemon.events import Decision
from crossover.daemon.leases import Leases
from crossover.daemon.phases import PhaseMachine
from crossover.daemon.registry import Registry, Session
from crossover.protos.event_records import LeaseExpired, Overdue, Release, Resume, Suspend

__all__ = ["Liveness", "LivenessSettings"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessSettings:
    """The liveness defaults, written once: crossoverd's flags, the scheduler and `Liveness` read them here.

    `heartbeat_timeout_s`: silent this long, a rank is suspended; `evict_after_s`: silent this long, it is
    removed; a holder past `overdue_factor` times its compute time and past `overdue_after_s` (its first
    phase: `overdue_warmup_s`), or past `max_hold_s` whatever it computes, is treated as stalled."""

    heartbeat_timeout_s: float = 0.8
    evict_after_s: float = 10.0
    overdue_factor: float = 10.0
    overdue_after_s: float = 3.0
    overdue_warmup_s: float = 30.0
    max_hold_s: float = 120.0


class Liveness:
    """Suspends, resumes, evicts and declares overdue, under the scheduler's lock."""

    def __init__(self, registry: Registry, leases: Leases, phases: PhaseMachine, pid_alive: Callable[[int], bool],
                 settings: LivenessSettings = LivenessSettings()) -> None:
        s = settings
        if s.evict_after_s < s.heartbeat_timeout_s:
            raise InvalidRequest(
                f"evict_after_s={s.evict_after_s} is shorter than heartbeat_timeout_s={s.heartbeat_timeout_s}")
        # Each may be changed in place (tests do); the settings give the start.
        self.heartbeat_timeout_s = s.heartbeat_timeout_s
        self.evict_after_s = s.evict_after_s
        self.overdue_factor = s.overdue_factor
        self.overdue_after_s = s.overdue_after_s
        self.overdue_warmup_s = s.overdue_warmup_s
        self.max_hold_s = s.max_hold_s
        self.overdue_total = 0  # holders treated as stalled since start
        self._registry = registry
        self._leases = leases
        self._phases = phases
        self._pid_alive = pid_alive

    def sweep(self, now: float, d: Decision) -> list[tuple[str, str]]:
        """Suspend the silent, declare the overdue, stop awaiting unanswered lease releases;
        returns (session id, reason) of each session to evict."""
        doomed = []
        for sess in self._registry:
            silent = now - sess.last_seen
            if sess.attached and silent > self.evict_after_s:
                doomed.append((sess.id, f"no heartbeat for {silent:.2f}s"))
            elif not sess.attached and now - sess.registered_at > max(5.0, 4 * self.heartbeat_timeout_s):
                doomed.append((sess.id, "registered but never opened its stream"))
            elif sess.ident.pid and not self._pid_alive(sess.ident.pid):
                doomed.append((sess.id, f"process {sess.ident.pid} is gone"))
            elif sess.attached and silent > self.heartbeat_timeout_s and sess.phase is not Phase.SUSPENDED:
                self._suspend(sess, silent, now, d)
            elif sess.phase is Phase.COMPUTE:
                self._check_overdue(sess, now, d)
        for device, sid in self._leases.unanswered(now, self.heartbeat_timeout_s):
            # A client that never answers must not block others.
            holder = self._registry.get(sid)
            _log.warning("%s rank %d did not give up computing without grants on device %d within "
                         "%.2fs; serving the device's other ranks anyway", holder.ident.job_name,
                         holder.ident.rank, device, self.heartbeat_timeout_s)
            d.log(holder, LeaseExpired())
            self._phases.end_revoke(device, sid, now, d)
        return doomed

    def _check_overdue(self, sess: Session, now: float, d: Decision) -> None:
        """A holder far past its own compute time, with a rank waiting for the device, is treated as stalled.

        Defence in depth: the plugin frees the device around every Horovod wait, but a
        script can still block while holding (another library's collective, a lock).
        Then the next waiter is served instead of every waiter paying its grant timeout.
        Before the rank's first measured phase the limit is the warm-up limit: a first step
        pays for lazy initialisation (allocators, kernels chosen by autotuning, a model's
        first pass), which is neither a stall nor a guide to the steps that follow.
        """
        policy = self._phases.policy
        key = sess.ref.key
        if not policy.blocks or not policy.holds(key):
            return
        held = now - sess.phase_since
        ema = sess.stats.compute_ema
        limit = min(self.max_hold_s, max(self.overdue_warmup_s, self.overdue_after_s) if ema is None
                    else max(self.overdue_after_s, self.overdue_factor * ema))
        if held <= limit or not policy.view(sess.ref.device).waiting:
            return
        _log.warning("%s rank %d has held device %d for %.2fs (limit %.2fs); treating it as stalled and "
                     "serving the next rank", sess.ident.job_name, sess.ident.rank, sess.ref.device, held, limit)
        self.move_aside(sess, now, d, limit_s=limit)

    def move_aside(self, sess: Session, now: float, d: Decision, limit_s: float | None = None,
                   reason: str | None = None) -> None:
        """Take the device from a holder (overdue past `limit_s`, or the operator's `evict`, for `reason`): it is
        treated as stalled (`OVERDUE`) until it reports its phase done, and the next rank is served."""
        held = now - sess.phase_since
        self.overdue_total += 1
        d.log(sess, Overdue(held_s=held, iteration=sess.iteration, limit_s=limit_s, reason=reason))
        sess.stats.compute_total += held
        sess.set_phase(Phase.OVERDUE, now)
        self._phases.deliver(self._phases.policy.release(sess.ref.key, now), now, d)

    def _suspend(self, sess: Session, silent: float, now: float, d: Decision) -> None:
        was = sess.phase
        d.log(sess, Suspend(reason=f"no heartbeat for {silent:.2f}s", phase=was.value))
        if was is Phase.COMPUTE:
            d.log(sess, Release(reason="suspended"))
            sess.forgive_done = True
        sess.set_phase(Phase.SUSPENDED, now)
        sess.suspended_from = was
        self._phases.deliver(self._phases.policy.leave(sess.ref.key, now), now, d)
        self._phases.forget_lease(sess, now, d)
        _log.warning("suspended %s rank %d: silent for %.2fs (its device is free; it resumes when it speaks again)",
                     sess.ident.job_name, sess.ident.rank, silent)

    def resume(self, sess: Session, silent: float, now: float, d: Decision) -> None:
        """A suspended rank spoke again: back in the rotation, its awaited grant requested again."""
        was, sess.suspended_from = sess.suspended_from, None
        sess.set_phase(Phase.OTHER, now)
        d.log(sess, Resume(silent_s=silent))
        self._phases.deliver(self._phases.policy.join(sess.ref, now), now, d)
        if was is Phase.WAITING:  # it still waits for that grant: queue the request again, same turn
            self._phases.queue_request(sess, sess.iteration, now, d)
        _log.info("resumed %s rank %d after %.2fs of silence", sess.ident.job_name, sess.ident.rank, silent)
