"""The daemon's contract: ranks, phases, grants, the policy interface and errors.

Everything the scheduler core, the policies, the simulator and the tests agree
on lives here; implementations live beside it (`policies/`, `scheduler.py`,
`server.py`). Policies are pure: they receive events with an explicit `now`
and return the ranks they grant, and never touch gRPC, threads or clocks.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from crossover.errors import CrossoverError
from crossover.protos import PROTOCOL_VERSION

if TYPE_CHECKING:
    from crossover.daemon.policies.classes import JobClass
    from crossover.daemon.policies.isolation import Change, IsolationView

__all__ = [
    "PROTOCOL_VERSION",
    "RankKey",
    "RankRef",
    "Phase",
    "DeviceView",
    "Policy",
    "CrossoverError",
    "InvalidRequest",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "UnsupportedVersion",
    "ResourceExhausted",
    "PermissionDenied",
]



@dataclass(frozen=True, order=True)
class RankKey:
    """A rank's identity across the cluster: the job it belongs to and its global rank."""

    job_id: str
    rank: int

    def __str__(self) -> str:
        return f"{self.job_id[:8]}/{self.rank}"


@dataclass(frozen=True)
class RankRef:
    """What a policy knows about a rank: who it is, where it runs, when it joined.

    `job_name` and `world_size` let policies order jobs the same way on every
    node without talking to each other (see `policies/crossover.py`).
    """

    key: RankKey
    job_name: str
    device: int
    world_size: int
    joined_at: float


class Phase(enum.Enum):
    """A rank's phase as the daemon sees it.

    Transitions (driven by rank events, each recorded in the event log):
      IDLE    -> WAITING  (COMPUTE_REQUEST)
      WAITING -> COMPUTE  (policy grants)
      COMPUTE -> OTHER    (COMPUTE_DONE)
      OTHER/COMPUTE -> COMM (COMM_BEGIN; a rank entering comm while holding a grant releases it)
      COMM    -> OTHER    (COMM_END)
      COMPUTE -> OVERDUE  (held its device far past its measured compute time: treated as stalled, the
                           device goes to the next waiter; its late COMPUTE_DONE ends it)
      any     -> SUSPENDED (silent past the heartbeat timeout: out of the rotation, its grant freed)
      SUSPENDED -> its old place (any event: back in the rotation; a request it was waiting on is re-queued)
      any     -> removed  (stream ended, process gone, silent past the eviction time)
    """

    IDLE = "idle"
    WAITING = "waiting"
    COMPUTE = "compute"
    COMM = "comm"
    OTHER = "other"
    SUSPENDED = "suspended"
    OVERDUE = "overdue"


@dataclass(frozen=True)
class DeviceView:
    """A policy's picture of one device: who holds it, who waits (in grant order).

    `holders` are ranks of one job in one iteration under a blocking policy (a
    job's ranks on one device compute together); `passthrough` lets any number
    of ranks compute at once.
    """

    device: int
    holders: tuple[RankKey, ...]
    waiting: tuple[RankKey, ...]
    order: tuple[str, ...] = ()


class Policy(Protocol):
    """Decides compute grants. One instance serves all devices of a node.

    Every method takes `now` (seconds, monotonic) and returns the ranks that
    are granted the device as a consequence of the event, in grant order.
    The scheduler guarantees calls are serialized, a rank joins before any
    other event about it, and `request` is only called for a rank that holds
    no grant and has no pending request.
    """

    name: str
    blocks: bool  # False: ranks need not wait for grants (observe-only)

    def join(self, rank: RankRef, now: float) -> list[RankKey]: ...

    def leave(self, key: RankKey, now: float) -> list[RankKey]: ...

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        """The rank asks for its device for its compute phase of `iteration` (its own counter)."""

    def occupy(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        """The rank computes already (under a lease, or since before the policy blocked): it
        holds its device from now on, whoever waits. Same precondition as `request`."""

    def release(self, key: RankKey, now: float) -> list[RankKey]: ...

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        """Withdraw a pending request (the rank went ahead without its grant)."""

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        """A measured phase length (`compute` or `comm`) reported by a rank."""

    def tick(self, now: float) -> list[RankKey]:
        """Called at `next_deadline` (the daemon also calls it periodically); lets a policy act on
        deadlines (bounded waiting)."""

    def next_deadline(self) -> float | None:
        """When `tick` must next run (the `now` clock's seconds), or None while no deadline is pending."""

    def decisions(self) -> dict[str, int]:
        """How often the policy made each of its notable choices since it started (backfills,
        bounded waits that timed out, overtakes): what an operator reads in metrics."""

    def classify(self, job_id: str, cls: JobClass, now: float) -> list[RankKey]:
        """The job's priority class and weight on this node changed (policies that ignore classes: nothing)."""

    def take_preemptions(self) -> list[RankKey]:
        """Holders to ask for a yield now (a higher-class rank waits behind them); each is returned once."""

    def take_isolation_changes(self) -> list[tuple[int, Change]]:
        """Each device's isolation budget changes since the last call (policies without classes: none)."""

    def isolating(self, device: int) -> bool:
        """Whether an isolation controller holds the device's highest class at its pace (`policies.isolation`)."""

    def isolation_view(self, device: int) -> IsolationView | None:
        """The device's isolation controller as `crossover queue` shows it; None while there is none."""

    def holds(self, key: RankKey) -> bool: ...

    def is_waiting(self, key: RankKey) -> bool: ...

    def view(self, device: int) -> DeviceView: ...


class InvalidRequest(CrossoverError, ValueError):
    """A request's field is malformed or out of range."""


class NotFound(CrossoverError, LookupError):
    """The request names a session, rank, device or policy the daemon does not know."""


class AlreadyExists(CrossoverError):
    """The rank is already registered with this daemon."""


class FailedPrecondition(CrossoverError):
    """The request is well-formed but not allowed in the current state."""


class UnsupportedVersion(CrossoverError):
    """The client speaks a protocol version this daemon does not."""


class PermissionDenied(CrossoverError, PermissionError):
    """The caller may not do this: a rank of one user asked to join another user's job."""


class ResourceExhausted(CrossoverError):
    """A client went past one of the daemon's limits (events per second, connections)."""
