"""The operator's side of the scheduler: the policy, the adaptive rule, the hand-over switch, drains,
evictions and what the admin calls show. A part of the scheduler, under its one lock; jobs' owners and
priority classes are `ownership.JobOwnership`, which it consults."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from crossover.daemon import policies
from crossover.daemon.api import FailedPrecondition, InvalidRequest, NotFound, Phase
from crossover.daemon.events import Decision
from crossover.daemon.grant_payoff import Mode, PayoffJudge, PayoffSettings, Verdict
from crossover.daemon.inventory import Device
from crossover.daemon.liveness import Liveness
from crossover.daemon.messages import PolicyMsg
from crossover.daemon.ownership import JobOwnership
from crossover.daemon.policies.classes import ClassSettings
from crossover.daemon.policies.isolation import IsolationView
from crossover.daemon.scheduler_state import SchedulerState
from crossover.daemon.snapshots import DeviceSnapshot, RankSnapshot, rank_snapshot, with_process_usage
from crossover.protos.event_records import Adapt, Drain, DrainRefused, Evict, HandoverSwitch, Policy, Resume, Sharing
from crossover.protos.identity import RankIdentity

__all__ = ["Steering"]

_log = logging.getLogger("crossover.daemon.scheduler")


class Steering:
    """The operator's calls and the per-device rules over the scheduler's state (see `Scheduler`).

    `close` is the scheduler's: an eviction closes a job's sessions as their leaving does."""

    def __init__(self, state: SchedulerState, ownership: JobOwnership, liveness: Liveness,
                 close: Callable[..., bool], class_settings: ClassSettings, payoff: PayoffSettings,
                 adapt: bool) -> None:
        self._state = state
        self._ownership = ownership
        self._liveness = liveness
        self._close = close
        self._class_settings = class_settings
        self._payoff = payoff
        self._adapting = adapt  # off: grants everywhere
        self._judges: dict[int, PayoffJudge] = {}
        self._drain_refused: dict[int, int] = {}  # device -> ranks refused since its drain began
        self._started = state.clock()

    def adapt(self) -> None:
        """Open each device where grants do not pay, close it where they do (see `grant_payoff`).

        Where the jobs on a device differ in priority class, grants pay when they pay its highest class:
        the production job keeps whichever mode it trains faster in. Where the highest class's jobs differ
        in weight, grants stay: a weight is a share of the grants, which an unscheduled device cannot give.

        Opening leases the device to every rank on it, and grants every rank waiting for it at once.
        Each change of a device's mode is in the event log (`sharing`) with its reason."""
        if not self._adapting:
            return
        changes: list[tuple[int, Verdict]] = []
        with self._state.lock:
            now = self._state.clock()
            wall = self._state.wall()
            if self._state.closed or not self._state.phases.policy.blocks:
                return
            d = Decision()
            by_device: dict[int, dict[str, int]] = {}  # device -> job -> phases the daemon saw its furthest rank end
            for sess in self._state.sessions:
                if sess.phase is not Phase.SUSPENDED:
                    jobs = by_device.setdefault(sess.ref.device, {})
                    job = sess.ref.key.job_id
                    jobs[job] = max(jobs.get(job, 0), sess.stats.compute_n)
            for device in self._state.inventory.devices:
                i = device.index
                progress = by_device.get(i, {})
                judge = self._judges.setdefault(i, PayoffJudge(self._payoff))
                before = judge.verdict
                priority = {job: self._state.phases.priority_of(job) for job in progress}
                highest = max(priority.values(), default=0)
                top = frozenset(j for j, p in priority.items() if p == highest)
                if self._ownership.classes_differ(top):  # a weight is a share of grants: unscheduled has none
                    verdict = judge.hold(Verdict(Mode.SCHEDULED, "its jobs differ in weight"))
                elif len(top) < len(progress) and self._state.phases.policy.isolating(i):
                    verdict = judge.hold(Verdict(Mode.SCHEDULED, "the isolation controller holds the highest "
                                                                 "class at its --protect pace"))
                else:
                    verdict = judge.sample(wall, progress, top if len(top) < len(progress) else None)
                is_open = i in self._state.leases.opened
                if verdict.mode is Mode.UNSCHEDULED and not is_open and self._state.leases.can_open(i):
                    self._open(i, now, d)
                elif verdict.mode is Mode.SCHEDULED and is_open:
                    self._state.leases.revoke(i, verdict.reason, d)
                if (verdict.mode, verdict.reason) != (before.mode, before.reason):
                    changes.append((i, verdict))
            self._state.commit(d, now)
        for i, verdict in changes:
            self._state.events.record(Sharing(device=i, mode=verdict.mode.value, reason=verdict.reason,
                                              score=verdict.score))
            if not verdict.probing:
                _log.info("device %d runs %s: %s", i, verdict.mode.value, verdict.reason)

    def _open(self, device: int, now: float, d: Decision) -> None:
        """Lease the device to every rank on it; the ranks waiting for it compute at once (lock held)."""
        self._state.leases.open(device, d)
        policy = self._state.phases.policy
        waiting = [s for s in self._state.sessions.on_device(device)
                   if s.phase is Phase.WAITING and policy.is_waiting(s.ref.key)]
        for sess in sorted(waiting, key=lambda s: s.requested_at):
            key = sess.ref.key
            if not policy.is_waiting(key):  # granted meanwhile, by the cancel of a rank before it
                continue
            self._state.phases.deliver(policy.cancel(key, now), now, d)
            self._state.phases.deliver(policy.occupy(key, sess.pending_iteration, now), now, d)

    def isolation(self, device: int) -> IsolationView | None:
        """The device's isolation controller, while one holds its highest class at its pace."""
        with self._state.lock:
            return self._state.phases.policy.isolation_view(device)

    def sharing(self, device: int) -> Verdict | None:
        """The device's mode and why, when the daemon measures whether grants pay (None: it does not)."""
        with self._state.lock:
            judge = self._judges.get(device)
            return None if not self._adapting or judge is None else judge.verdict

    @property
    def adapting(self) -> bool:
        """Whether each device measures if its grants pay (`adapt`), as `crossoverd --adapt` or the operator set."""
        return self._adapting

    def set_adapt(self, on: bool, caller: str = "") -> bool:
        """The operator's `crossover policy --adapt/--no-adapt`. On starts every device's measurement afresh;
        off closes every device that runs unscheduled (a lease revoke), so grants hold everywhere again."""
        def apply(d: Decision) -> None:
            self._adapting = on
            self._judges.clear()
            for device in sorted(self._state.leases.opened) if not on else ():
                self._state.leases.revoke(device, "the operator switched adapt off", d)

        return self._switch("adapt", Adapt(on=on, caller=caller), lambda: self._adapting, apply)

    def _switch(self, what: str, switch: Adapt | HandoverSwitch, current: Callable[[], bool],
                apply: Callable[[Decision], None]) -> bool:
        """An operator's on/off switch (`switch.on`, asked by `switch.caller`): `apply` it under the lock unless it
        is `current` already, then log `switch`."""
        on, caller = switch.on, switch.caller
        with self._state.lock:
            now = self._state.clock()
            if on == current():
                return on
            d = Decision()
            apply(d)
            self._state.commit(d, now)
        self._state.events.record(switch)
        _log.warning("operator switched %s %s (%s)", what, "on" if on else "off", caller or "?")
        return on

    @property
    def handing_over(self) -> bool:
        """Whether ranks that can end their turns on their device do (`crossoverd --handover`, the operator)."""
        return self._state.phases.handover_on

    def set_handover(self, on: bool, caller: str = "") -> bool:
        """The operator's `crossover policy --handover/--no-handover`; off for good without turn pages here."""
        on = on and self._state.phases.pages is not None

        def apply(d: Decision) -> None:  # every rank learns at once whether its device hands over
            self._state.phases.handover_on = on
            for device in self._state.inventory.devices:
                self._state.phases.tell_share(device.index, d)

        return self._switch("the hand-over on the device", HandoverSwitch(on=on, caller=caller),
                            lambda: self._state.phases.handover_on, apply)

    @property
    def policy_name(self) -> str:
        return self._state.phases.policy.name

    def policy_decisions(self) -> dict[str, int]:
        """The current policy's decision counts (`Policy.decisions`); they start again at a switch."""
        with self._state.lock:
            return dict(self._state.phases.policy.decisions())

    @property
    def protect(self) -> float:
        """The share of its speed alone the highest class on a device keeps (`crossoverd --protect`; 0: off)."""
        return self._class_settings.isolation.target

    def set_policy(self, name: str, caller: str = "", protect: float | None = None) -> str:
        """Switch policy at once; ranks computing or waiting are re-queued under the new one. `protect`
        (None: as is) sets the isolation target from now on (`crossover policy --protect`); the policy then
        starts afresh even if `name` is the current one. `caller` says who asked, as the event log and the
        daemon log record it."""
        d = Decision()
        with self._state.lock:  # two operators' calls at once: one policy and its settings, then the other's
            settings = self._class_settings
            if protect is not None:
                try:
                    settings = replace(settings, isolation=replace(settings.isolation, target=protect))
                except ValueError:
                    raise InvalidRequest(f"protect {protect:g}: must be within 0..1 (0 turns the isolation "
                                         "controller off)") from None
            new = policies.create(name, settings, self._state.wall() - self._state.clock())
            self._class_settings = settings
            now = self._state.clock()
            old = self._state.phases.policy
            for device in self._state.leases.leased_devices():
                self._state.leases.revoke(device, f"policy switched to {name}", d)
            if new.blocks and not old.blocks:
                # Ranks computed without grants and report late: each must first say what it
                # is doing (its answer follows any request it computes under), as for a lease.
                for sess in self._state.sessions:
                    if sess.accepts_leases and sess.phase is not Phase.SUSPENDED:
                        self._state.leases.await_release(sess, f"policy switched to {name}", d)
            self._state.phases.policy = new
            for sess in sorted(self._state.sessions, key=lambda s: s.registered_at):
                if sess.phase is not Phase.SUSPENDED:
                    new.join(sess.ref, now)
            for job_id, cls in self._ownership.classes():
                new.classify(job_id, cls, now)
            active = [s for s in self._state.sessions if s.phase in (Phase.COMPUTE, Phase.WAITING)]
            active.sort(key=lambda s: (s.phase is not Phase.COMPUTE, s.requested_at))
            for sess in active:
                # A rank granted under the old policy computes: it keeps its device.
                if not self._state.leases.defer(sess):
                    claim = new.occupy if sess.phase is Phase.COMPUTE else new.request
                    self._state.phases.deliver(claim(sess.ref.key, sess.pending_iteration, now), now, d)
            for sess in self._state.sessions:
                d.post(sess, PolicyMsg(new.name, new.blocks))
            self._state.commit(d, now)
        target = settings.isolation.target
        self._state.events.record(Policy(old=old.name, new=name, protect=target, caller=caller))
        _log.warning("operator switched policy %s -> %s, protect %g (%s)", old.name, name, target, caller or "?")
        return name

    def instead_of_drained(self, device: Device, ident: RankIdentity) -> Device:
        """The device for a new rank whose device the operator drained (called with the lock held).

        A rank on a CPU device computes on the cores the daemon names, so it goes to the free
        device with the fewest ranks, if one is left. A GPU rank's script picks its GPU itself:
        it is refused, trains unscheduled there, and is counted (`crossover queue`, metrics)."""
        if device.kind == "cpu" and ident.device < 0:
            load = {d.index: 0 for d in self._state.inventory.devices if d.index not in self._state.leases.draining}
            for sess in self._state.sessions:
                if sess.ref.device in load:
                    load[sess.ref.device] += 1
            if load:
                other = self._state.inventory.by_index(min(load, key=lambda i: (load[i], i)))
                _log.info("%s rank %d: device %d is drained; placed on device %d", ident.job_name, ident.rank,
                          device.index, other.index)
                return other
        self._drain_refused[device.index] = self._drain_refused.get(device.index, 0) + 1
        self._state.events.record(DrainRefused(device=device.index, job=ident.job_id, job_name=ident.job_name,
                                               rank_refused=ident.rank))
        _log.warning("%s rank %d refused: device %d is drained; it trains unscheduled there", ident.job_name,
                     ident.rank, device.index)
        raise FailedPrecondition(
            f"device {device.index} was drained by this node's operator and takes no new ranks "
            f"(`crossover resume {device.index}` reopens it); this rank trains on it unscheduled")

    def drain(self, device: int, draining: bool, caller: str = "") -> bool:
        """The operator's `crossover drain` / `resume`: new ranks go elsewhere (or are refused), those
        on the device stay. `caller` says who asked, as the event log and the daemon log record it."""
        self._state.inventory.by_index(device)
        d = Decision()
        with self._state.lock:
            now = self._state.clock()
            (self._state.leases.draining.add if draining else self._state.leases.draining.discard)(device)
            if draining:
                self._state.leases.revoke(device, "device draining", d)
            self._drain_refused.pop(device, None)
            self._state.commit(d, now)
        self._state.events.record(Drain(device=device, caller=caller) if draining
                                  else Resume(device=device, caller=caller))
        _log.warning("operator %s device %d (%s)", "drained" if draining else "resumed", device, caller or "?")
        return draining

    def drain_refusals(self, device: int) -> int:
        """Ranks refused on `device` since its drain began (they train unscheduled there)."""
        with self._state.lock:
            return self._drain_refused.get(device, 0)

    def evict(self, device: int = -1, job: str = "", caller: str = "") -> list[str]:
        """The operator's `crossover evict`: take `device` back from its holders now (each is treated
        as overdue and the next rank is served), and/or close every session of `job` (id or name) on
        this node. Returns a line per rank touched; an empty list when the device had no holder. A job with
        no rank here is refused (`NotFound`, as `set_job_class` refuses it), and nothing is logged."""
        if device >= 0:
            self._state.inventory.by_index(device)
        done: list[str] = []
        doomed: list[str] = []
        with self._state.lock:
            if job and not any(job in (s.ident.job_id, s.ident.job_name) for s in self._state.sessions):
                raise NotFound(f"no job {job!r} has ranks on this node (`crossover jobs` lists them)")
            now = self._state.clock()
            d = Decision()
            for sess in list(self._state.sessions):
                name = f"{sess.ident.job_name} rank {sess.ident.rank} on device {sess.ref.device}"
                if job and job in (sess.ident.job_id, sess.ident.job_name):
                    doomed.append(sess.id)
                    done.append(f"{name}: evicted")
                elif (device >= 0 and sess.ref.device == device and sess.phase is Phase.COMPUTE
                      and self._state.phases.policy.holds(sess.ref.key)):
                    self._liveness.move_aside(sess, now, d, reason="evicted by the operator")
                    done.append(f"{name}: moved aside")
            self._state.commit(d, now)
        for sid in doomed:
            self._close(sid, "evicted by the operator", evicted=True)
        self._state.events.record(Evict(device=device, job=job, touched=len(done), caller=caller))
        _log.warning("operator evict (device %s, job %r; %s): %s", device if device >= 0 else "-", job,
                     caller or "?", "; ".join(done) or "nothing matched")
        return done

    def sessions_by_uid(self) -> dict[str, int]:
        """Registered ranks per local user (the kernel's uid of a session socket peer; "unknown" for
        ranks on the gRPC stream or not yet attached)."""
        with self._state.lock:
            counts: dict[str, int] = {}
            for sess in self._state.sessions:
                key = "unknown" if sess.uid is None else str(sess.uid)
                counts[key] = counts.get(key, 0) + 1
            return counts

    def is_draining(self, device: int) -> bool:
        with self._state.lock:
            return device in self._state.leases.draining

    def uptime(self) -> float:
        return self._state.clock() - self._started

    def snapshot(self) -> tuple[dict[int, DeviceSnapshot], list[RankSnapshot]]:
        """Per device: (holders, waiting in grant order, others, job order); plus all ranks.

        Requests held back while a lease is given up are listed last among the waiting.
        """
        with self._state.lock:
            now = self._state.clock()
            sessions = self._state.sessions.items()
            snaps = {sid: rank_snapshot(s, now) for sid, s in sessions}
            processes = [(sid, s.process) for sid, s in sessions if s.process is not None]
            by_key = {s.ref.key: sid for sid, s in sessions}
            views = {dev.index: self._state.phases.policy.view(dev.index) for dev in self._state.inventory.devices}
            for sid, s in sessions:
                cls, by = self._ownership.class_and_setter(s.ref.key.job_id)
                snaps[sid] = replace(snaps[sid], priority=str(cls.priority), weight=cls.weight, class_by=by)
            held_back = self._state.leases.held_back()
            devices = {sid: s.ref.device for sid, s in sessions}
        for sid, proc in processes:  # psutil reads /proc: outside the lock
            snaps[sid] = with_process_usage(snaps[sid], proc)
        out = {}
        for index, view in views.items():
            queued = (*view.waiting, *held_back.get(index, ()))
            holders = [snaps[by_key[k]] for k in view.holders if k in by_key]
            waiting = [snaps[by_key[k]] for k in queued if k in by_key]
            seen = {by_key[k] for k in (*view.holders, *queued) if k in by_key}
            others = [snaps[sid] for sid, d in devices.items() if d == index and sid not in seen]
            out[index] = DeviceSnapshot(holders, waiting, others, view.order)
        return out, list(snaps.values())

