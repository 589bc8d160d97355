"""The ranks registered with this daemon: one `Session` each, found by session id or by rank.

A session is the daemon's whole record of a rank: who it is (`RankIdentity`),
where it runs (`RankRef`), its phase, its pending request, its measured phase
times and how to reach its stream. The registry itself holds no lock: the
scheduler owns it and touches it under its own.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Callable

import psutil

from crossover.daemon.api import InvalidRequest, NotFound, Phase, RankKey, RankRef
from crossover.daemon.messages import Message
from crossover.daemon.policies.classes import JobClass, Priority
from crossover.daemon.policies.memory import MemoryCap
from crossover.protos.identity import RankIdentity

__all__ = ["Registration", "Registry", "Session", "Stats", "validate_identity"]

_MAX_WORLD = 1 << 20


@dataclass(frozen=True)
class Registration:
    """The answer to a registration: the session, its placement and the node's policy."""

    session_id: str
    node: str
    device: int
    cpu_affinity: tuple[int, ...]
    heartbeat_interval_s: float
    policy: str
    policy_blocks: bool


@dataclass
class Stats:
    """A rank's measured phase times since it registered."""

    compute_total: float = 0.0
    compute_n: int = 0
    comm_total: float = 0.0
    comm_n: int = 0
    waited_total: float = 0.0
    compute_ema: float | None = None  # its whole compute phases (yielded pieces added up)


@dataclass
class Session:
    """One registered rank, as the scheduler sees it.

    `phase` is what the rank does as far as the daemon knows; whether it holds its
    device's grant is the policy's to say (`Policy.holds`). A rank can compute
    without holding a grant: under a policy that does not block, or while a
    policy switch holds its claim back.
    """

    id: str
    ident: RankIdentity
    ref: RankRef
    registered_at: float
    last_seen: float
    deliver: Callable[[Message], None] | None = None
    undelivered: list[Message] = field(default_factory=list)  # messages sent before the stream attached
    attached: bool = False
    phase: Phase = Phase.IDLE
    phase_since: float = 0.0
    iteration: int = -1
    pending_seq: int = 0
    requested_at: float = 0.0
    pending_iteration: int = 0  # the iteration of its pending (or granted) compute request
    suspended_from: Phase | None = None  # the phase it was silenced in (while SUSPENDED)
    forgive_done: bool = False  # its grant was taken while it was silent: a late COMPUTE_DONE is no error
    yielded_s: float = 0.0  # device time of the current iteration's phase before it yielded
    accepts_leases: bool = False
    no_wait: bool = False  # the rank computes without waiting for the pending request's grant
    last_t: float = 0.0  # the date of its latest logged entry: its next ones are never dated earlier
    floor_t: float = 0.0  # when its previous message with events arrived: no later event is dated earlier
    stats: Stats = field(default_factory=Stats)
    process: psutil.Process | None = None
    uid: int | None = None  # the kernel's uid of its session socket peer (None: not known, e.g. gRPC)
    asked: Priority | None = None  # the class the rank asked for (CROSSOVER_PRIORITY); None: none
    klass: JobClass = field(default_factory=JobClass)  # the class this rank is given (its job's is the lowest)
    class_by: str = ""  # what gave it: a --class-rule's text, "rank" (it lowered itself) or "" (the default)
    accepts_preempt: bool = False  # the client yields on Directive.preempt
    class_note: str = ""  # the refusal line it was last told (told once)
    accepts_handover: bool = False  # the client takes turn pages (`handover`) on its session socket
    handover: str = ""  # "device": it ends its turns on its device (its own page is mapped); "": the usual way
    pages_sent: set[int] = field(default_factory=set)  # the turn pages it holds a descriptor of
    memory_cap: MemoryCap = field(default_factory=MemoryCap)  # what it may hold on its device, as last told
    memory_note: str = ""  # its last out-of-memory at its cap, in one line

    def send(self, msg: Message) -> None:
        if self.deliver is None:
            self.undelivered.append(msg)
        else:
            self.deliver(msg)

    def set_phase(self, phase: Phase, now: float) -> None:
        self.phase = phase
        self.phase_since = now


class Registry:
    """Sessions by id and by rank, in registration order."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[RankKey, Session] = {}

    def add(self, sess: Session) -> None:
        self._by_id[sess.id] = sess
        self._by_key[sess.ref.key] = sess

    def pop(self, session_id: str) -> Session | None:
        """Remove a session; None if it is not (or no longer) registered."""
        sess = self._by_id.pop(session_id, None)
        if sess is not None:
            del self._by_key[sess.ref.key]
        return sess

    def clear(self) -> list[Session]:
        """Remove every session; returns them."""
        sessions = list(self._by_id.values())
        self._by_id.clear()
        self._by_key.clear()
        return sessions

    def get(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}: register first (or it was evicted)") from None

    def __getitem__(self, session_id: str) -> Session:
        return self._by_id[session_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def by_key(self, key: RankKey) -> Session | None:
        return self._by_key.get(key)

    def on_device(self, device: int) -> list[Session]:
        return [s for s in self._by_id.values() if s.ref.device == device]

    def of_job(self, job_id: str) -> list[Session]:
        return [s for s in self._by_id.values() if s.ref.key.job_id == job_id]

    def __iter__(self) -> Iterator[Session]:
        return iter(self._by_id.values())

    def items(self) -> list[tuple[str, Session]]:
        return list(self._by_id.items())


def printable(text: str) -> str:
    """`text` with each character that is not printable (a newline, an ANSI escape, any control)
    written as its escape: what a client names goes into logs and terminals as inert text."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable_identity(ident: RankIdentity) -> RankIdentity:
    """The identity with its job's id and name made `printable`, as the daemon keeps and shows it."""
    if ident.job_id.isprintable() and ident.job_name.isprintable():
        return ident
    return replace(ident, job_id=printable(ident.job_id), job_name=printable(ident.job_name))


def validate_identity(ident: RankIdentity, n_devices: int) -> None:
    """`InvalidRequest` unless the identity describes a rank that can exist on a node of `n_devices`."""
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
