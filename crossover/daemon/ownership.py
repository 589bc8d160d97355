"""Whose a job is on this node and the class it runs at: a part of the scheduler, under its one lock.

A job id is a name a client chooses; the kernel names a rank's user on the session socket
(`bind_peer`). A job on a node belongs to the first user named for it, and its class is the
operator's, else the lowest its ranks were given (`class_rules`) and asked for."""
from __future__ import annotations

import logging
from collections.abc import Iterable

from crossover.daemon.api import InvalidRequest, NotFound, PermissionDenied
from crossover.daemon.class_rules import ClassRules, effective_class
from crossover.daemon.events import Decision
from crossover.daemon.messages import ClassMsg
from crossover.daemon.policies.classes import JobClass, Priority
from crossover.daemon.registry import Session
from crossover.daemon.scheduler_state import SchedulerState
from crossover.protos import event_records
from crossover.protos.event_records import JobClassSet

__all__ = ["JobOwnership"]

_log = logging.getLogger("crossover.daemon.scheduler")


class JobOwnership:
    """Jobs' owners and classes over the scheduler's state. The scheduler calls `check_owner`, `give_class`,
    `reclassify` and the readers with the lock held; the calls from outside (`refuse_unnamed`,
    `set_job_class`) take it themselves."""

    def __init__(self, state: SchedulerState, rules: ClassRules) -> None:
        self._state = state
        self._rules = rules
        self._classes: dict[str, tuple[JobClass, str]] = {}  # job -> its class as the policy has it, and by what
        self._set_by_operator: dict[str, JobClass] = {}  # job -> the class `crossover priority/share` set

    def class_of(self, job_id: str) -> JobClass:
        """The job's class as the policy has it (the default for a job it has not classed); lock held."""
        return self._classes.get(job_id, (JobClass(), ""))[0]

    def classes_differ(self, jobs: Iterable[str]) -> bool:
        """Whether these jobs are of different classes or weights on this node (lock held)."""
        return len({self.class_of(job) for job in jobs}) > 1

    def classes(self) -> list[tuple[str, JobClass]]:
        """Every classed job and its class, by job id (lock held): what a new policy is told."""
        return [(job, cls) for job, (cls, _) in sorted(self._classes.items())]

    def class_and_setter(self, job_id: str) -> tuple[JobClass, str]:
        """The job's class and what set it (lock held)."""
        return self._classes.get(job_id, (JobClass(), ""))

    def check_owner(self, sess: Session, uid: int | None) -> None:
        """PermissionDenied unless the job's ranks here are of no other named user than `uid` (None: the
        kernel did not name this rank's user, so the job must have no named user at all)."""
        owners = self._users_of(sess.ref.key.job_id, but=sess)
        if not owners or uid in owners:
            return
        job = sess.ident.job_name or sess.ref.key.job_id[:8]
        if uid is None:
            raise PermissionDenied(
                f"job {job} on this node is run by uid {min(owners)}, which the session socket vouches for; "
                "a rank on the gRPC stream cannot join it (use the session socket: CROSSOVER_TRANSPORT=auto)")
        raise PermissionDenied(
            f"job {job} on this node is run by uid {min(owners)}; a rank of uid {uid} cannot join it "
            "(a job id is only a name: a job of your own needs an id of its own)")

    def refuse_unnamed(self, session_id: str) -> None:
        """A rank on the gRPC stream, whose user the kernel does not name, may not join a job whose ranks on
        this node the kernel named (`bind_peer`): its job id would otherwise be only its claim. The job's
        own ranks reach the session socket; one that falls back to gRPC is refused and asks again."""
        with self._state.lock:
            sess = self._state.sessions.find(session_id)
            if sess is not None and sess.uid is None:
                self.check_owner(sess, None)

    def give_class(self, sess: Session, uid: int | None, gid: int | None) -> str:
        """Set the class the session's rank is given (its user's, lowered as it asked); the refusal line, if any.
        Before the kernel names its user, a rank that asks for a class some rule may give it waits for that,
        and so does a rank that asks to lower a job whose ranks here the kernel has named: it may be another
        user's process, which `bind_peer` refuses."""
        given, by = self._rules.given(uid, gid)
        if uid is None and sess.asked is not None and (
                (sess.asked > given.priority and self._rules.could_give(sess.asked))
                or (sess.asked < given.priority and self._users_of(sess.ref.key.job_id))):
            sess.klass, sess.class_by = given, by
            return ""
        sess.klass, note = effective_class(sess.asked, given, by)
        sess.class_by = "rank" if sess.klass.priority < given.priority else by
        if note == sess.class_note:
            return ""
        sess.class_note = note
        return note

    def _users_of(self, job_id: str, but: Session | None = None) -> set[int]:
        """The users the kernel named (`bind_peer`) for the job's ranks on this node, `but` left out."""
        return {s.uid for s in self._state.sessions.of_job(job_id) if s is not but and s.uid is not None}

    def reclassify(self, job_id: str, now: float, d: Decision, tell: tuple[Session, str] | None = None) -> None:
        """Give the job its class on this node (the operator's, else the lowest of its ranks'); when it
        changes, the policy decides again and every rank of the job is told. `tell`: a session to tell
        in any case, with its note (a new rank)."""
        ranks = self._state.sessions.of_job(job_id)
        if not ranks:
            self._classes.pop(job_id, None)
            self._set_by_operator.pop(job_id, None)
            return
        operator = self._set_by_operator.get(job_id)
        cls, by = (operator, "operator") if operator else min(((s.klass, s.class_by) for s in ranks),
                                                              key=lambda c: (c[0].priority, c[0].weight))
        before = self._classes.get(job_id)
        self._classes[job_id] = (cls, by)
        # A job of the default class that always was needs no word: nothing is logged or sent for it.
        changed = before != (cls, by) and (cls != JobClass() or (before is not None and before[0] != JobClass()))
        if changed:
            d.log(ranks[0], event_records.JobClass(priority=str(cls.priority), weight=cls.weight, by=by))
            self._state.phases.deliver(self._state.phases.policy.classify(job_id, cls, now), now, d)
            for device in {s.ref.device for s in ranks}:  # whether its ranks hand over there may change
                self._state.phases.tell_share(device, d)
        told, note = tell if tell is not None else (None, "")
        for s in ranks:
            if changed or (s is told and (note or cls != JobClass())):
                d.post(s, ClassMsg(cls, note if s is told else ""))

    def set_job_class(self, job: str, priority: Priority | None = None, weight: float | None = None,
                      caller: str = "") -> tuple[str, JobClass]:
        """The operator's `crossover priority` / `share`: set a job's class or weight on this node (the job by id
        or name; None keeps that part). Its ranks are told; the policy decides again. Returns (job id, class)."""
        with self._state.lock:
            now = self._state.clock()
            ids = sorted({s.ref.key.job_id for s in self._state.sessions
                          if job in (s.ref.key.job_id, s.ident.job_name)})
            if not ids:
                raise NotFound(f"no job {job!r} has ranks on this node (`crossover jobs` lists them)")
            if len(ids) > 1:
                raise InvalidRequest(f"{len(ids)} jobs are named {job!r} here; give the job id ({', '.join(ids)})")
            (job_id,) = ids
            current = self._classes.get(job_id, (JobClass(), ""))[0]
            cls = JobClass(current.priority if priority is None else priority, weight or current.weight)
            self._set_by_operator[job_id] = cls
            d = Decision()
            self.reclassify(job_id, now, d)
            self._state.commit(d, now)
        self._state.events.record(JobClassSet(job=job_id, priority=str(cls.priority), weight=cls.weight,
                                              caller=caller))
        _log.warning("operator set job %s to %s (%s)", job_id, cls, caller or "?")
        return job_id, cls
