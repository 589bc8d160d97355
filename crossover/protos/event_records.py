"""Each event's payload as one typed record: what the daemon writes on an event's line, and what a reader gets back.

One frozen dataclass per `EventName`, named after it (`Grant` for `grant`), knows its name (`Grant.name`) and
holds the keys its line carries beyond `t`, `wall`, `event` and, for an event about a rank, the rank's tag
(`RankTag`: job, job_name, rank, device, node; a reader finds them on `Event`). The daemon writes a record
(`EventLog.record(Grant(...), about=RankTag(...))`), so no payload can be misspelt or forgotten; a reader
builds it back from an `Event` with `Grant.of(event)`, or with `payload(event)` for any known name.

A field without a default is on every line of its event. A field with one is optional: the daemon writes it
only when it differs from its default, and a line without it (an older daemon's, or one that had nothing to
say) reads as that default. Keys a record does not know (a newer daemon's) are ignored; a line that lacks a
required field, or holds a value of another type, is refused (`ValueError`), as is an event of another name.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar, Union

from crossover.protos.event_file import Event, EventName

__all__ = ["RANK_KEYS", "RECORDS", "RankTag", "Record", "payload",
           "Register", "Leave", "Request", "Grant", "Release", "Cancel", "CommBegin", "CommEnd", "Overdue",
           "OverdueDone", "Suspend", "Resume", "Lease", "LeaseRevoke", "LeaseReleased", "LeaseExpired", "JobClass",
           "Preempt", "Handover", "HandoverRescue", "DrainRefused", "MemoryCap", "MemoryCapHit", "Policy", "Drain",
           "Evict", "Sharing", "Isolation", "Adapt", "HandoverSwitch", "JobClassSet"]

RANK_KEYS = ("job", "job_name", "rank", "device", "node")
"""The keys of a rank event's tag, in their order on its line: never part of its payload."""

_R = TypeVar("_R", bound="Record")

RECORDS: dict[EventName, type[Record]] = {}
"""Each event's record, by its name."""


class RankTag(NamedTuple):
    """Which rank an event is about: the keys its line carries between `event` and the payload (a tuple, as
    the daemon builds one for every event it logs about a rank)."""

    job: str
    job_name: str
    rank: int
    device: int
    node: str

    def fields(self) -> dict[str, Any]:
        return {"job": self.job, "job_name": self.job_name, "rank": self.rank, "device": self.device,
                "node": self.node}


@dataclass(frozen=True)
class _Field:
    name: str
    types: tuple[type, ...]
    default: Any  # dataclasses.MISSING: required


@dataclass(frozen=True, kw_only=True)
class Record:
    """One event's payload; subclasses name their event (`name`) and declare its fields, in their order on the line."""

    name: ClassVar[EventName]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name in RECORDS:
            raise TypeError(f"{cls.__name__}: {RECORDS[cls.name].__name__} is the record of {cls.name} already")
        RECORDS[cls.name] = cls

    def fields(self) -> dict[str, Any]:
        """The payload's keys and values as its line holds them: each required field, and each optional one that
        differs from its default."""
        out: dict[str, Any] = {}
        for f in _spec(type(self)):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def of(cls: type[_R], event: Event) -> _R:
        """The record of `event`, which must be of this record's name (`ValueError` otherwise, or for a line
        that lacks a required field or holds a value of another type); unknown keys are ignored, a missing
        optional one takes its default. An event about a rank keeps its tag out of the payload."""
        if event.name != cls.name:
            raise ValueError(f"a {event.name} event is not a {cls.name} event")
        given = event.fields
        tagged = event.about_rank
        values: dict[str, Any] = {}
        for f in _spec(cls):
            if f.name not in given or (tagged and f.name in RANK_KEYS):
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"{cls.name} event at t={event.t:.6f} lacks {f.name!r}")
                continue
            values[f.name] = _checked(cls.name, f, given[f.name])
        return cls(**values)


_SPECS: dict[type[Record], tuple[_Field, ...]] = {}


def _spec(cls: type[Record]) -> tuple[_Field, ...]:
    """The record's fields in their order, each with the types a line's value may have and its default."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        spec = _SPECS[cls] = tuple(_Field(f.name, _accepted(hints[f.name]), f.default) for f in dataclasses.fields(cls))
    return spec


def _accepted(hint: Any) -> tuple[type, ...]:
    members = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return tuple(type(None) if m is None else m for m in members)


def _checked(name: EventName, f: _Field, value: Any) -> Any:
    if isinstance(value, bool):
        ok = bool in f.types
    elif isinstance(value, int) and float in f.types and int not in f.types:
        return float(value)  # a writer's int in a float field (a weight of 2): the same number
    else:
        ok = isinstance(value, f.types)
    if not ok:
        raise ValueError(f"{name} event: {f.name}={value!r} is not of type "
                         f"{' | '.join(t.__name__ for t in f.types)}")
    return value


def payload(event: Event) -> Record | None:
    """The record of any event of a known name (`ValueError` for a malformed line); None for a name this code
    does not know (a newer daemon's), whose keys stay in `event.fields`."""
    kind = RECORDS.get(event.name) if isinstance(event.name, EventName) else None
    return kind.of(event) if kind is not None else None


# About a rank: written with its RankTag.

@dataclass(frozen=True, kw_only=True)
class Register(Record):
    """A rank joined; `framework` (`horovod`, `ddp`) is on lines written since crossoverd names it."""

    name: ClassVar[EventName] = EventName.REGISTER
    pid: int
    world_size: int
    framework: str | None = None


@dataclass(frozen=True, kw_only=True)
class Leave(Record):
    """A rank left; `evicted`: the daemon removed it (None: not said, as at the daemon's shutdown)."""

    name: ClassVar[EventName] = EventName.LEAVE
    reason: str
    evicted: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Request(Record):
    """A rank asked for its device for iteration `iteration` (its request's `seq`)."""

    name: ClassVar[EventName] = EventName.REQUEST
    iteration: int
    seq: int


@dataclass(frozen=True, kw_only=True)
class Grant(Record):
    """A rank was granted its device after waiting `waited_s`; `after`: the ticket its device waits for first
    (0: none)."""

    name: ClassVar[EventName] = EventName.GRANT
    iteration: int
    waited_s: float
    after: int = 0


@dataclass(frozen=True, kw_only=True)
class Release(Record):
    """A holder's compute phase ended after `held_s` (`yields`: it gave its turn up before its phase was done),
    or it ended without a figure: suspended, or gone (`reason`)."""

    name: ClassVar[EventName] = EventName.RELEASE
    held_s: float | None = None
    yields: bool = False
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Cancel(Record):
    """A waiting rank withdrew its request (its grant timed out, or it does not wait)."""

    name: ClassVar[EventName] = EventName.CANCEL


@dataclass(frozen=True, kw_only=True)
class CommBegin(Record):
    """A rank began its allreduce of iteration `iteration`."""

    name: ClassVar[EventName] = EventName.COMM_BEGIN
    iteration: int


@dataclass(frozen=True, kw_only=True)
class CommEnd(Record):
    """A rank's allreduce of iteration `iteration` ended after `duration_s`."""

    name: ClassVar[EventName] = EventName.COMM_END
    iteration: int
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class Overdue(Record):
    """A holder was passed over after holding `held_s`: past its `limit_s`, or evicted by the operator (`reason`)."""

    name: ClassVar[EventName] = EventName.OVERDUE
    held_s: float
    iteration: int
    limit_s: float | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class OverdueDone(Record):
    """A holder passed over ended its phase, `late_s` after it was."""

    name: ClassVar[EventName] = EventName.OVERDUE_DONE
    late_s: float


@dataclass(frozen=True, kw_only=True)
class Suspend(Record):
    """A rank fell silent (`reason`) in phase `phase`: it leaves the rotation until it speaks again."""

    name: ClassVar[EventName] = EventName.SUSPEND
    reason: str
    phase: str


@dataclass(frozen=True, kw_only=True)
class Resume(Record):
    """A suspended rank spoke again after `silent_s` (about a rank); or, without a rank, the operator resumed
    a drained `device` (`caller`)."""

    name: ClassVar[EventName] = EventName.RESUME
    silent_s: float | None = None
    device: int | None = None
    caller: str | None = None


@dataclass(frozen=True, kw_only=True)
class Lease(Record):
    """A rank may compute without grants; `opened`: its device was opened because grants do not pay there."""

    name: ClassVar[EventName] = EventName.LEASE
    opened: bool = False


@dataclass(frozen=True, kw_only=True)
class LeaseRevoke(Record):
    """A rank's lease was taken back (`reason`); the daemon awaits its release."""

    name: ClassVar[EventName] = EventName.LEASE_REVOKE
    reason: str


@dataclass(frozen=True, kw_only=True)
class LeaseReleased(Record):
    """A rank whose lease was revoked said what it is doing."""

    name: ClassVar[EventName] = EventName.LEASE_RELEASED


@dataclass(frozen=True, kw_only=True)
class LeaseExpired(Record):
    """A rank whose lease was revoked did not answer in time: the device's others are served anyway."""

    name: ClassVar[EventName] = EventName.LEASE_EXPIRED


@dataclass(frozen=True, kw_only=True)
class JobClass(Record):
    """The rank's job's class here changed: `priority`, `weight`, and what set it (`by`)."""

    name: ClassVar[EventName] = EventName.JOB_CLASS
    priority: str
    weight: float
    by: str


@dataclass(frozen=True, kw_only=True)
class Preempt(Record):
    """A holder was asked to yield to a rank of a higher class."""

    name: ClassVar[EventName] = EventName.PREEMPT


@dataclass(frozen=True, kw_only=True)
class Handover(Record):
    """A rank ends its turns on its device from now on (`path`: `device`)."""

    name: ClassVar[EventName] = EventName.HANDOVER
    path: str


@dataclass(frozen=True, kw_only=True)
class HandoverRescue(Record):
    """The daemon stored the turn ticket `ticket` a rank's device owed (`reason`: it died or stalled)."""

    name: ClassVar[EventName] = EventName.HANDOVER_RESCUE
    ticket: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class MemoryCap(Record):
    """What a rank may hold on its device changed: `cap_bytes` (None: no cap), and `why`."""

    name: ClassVar[EventName] = EventName.MEMORY_CAP
    cap_bytes: int | None
    why: str


@dataclass(frozen=True, kw_only=True)
class MemoryCapHit(Record):
    """A rank's allocator refused `asked_bytes` more at its cap `cap_bytes`, in iteration `iteration`."""

    name: ClassVar[EventName] = EventName.MEMORY_CAP_HIT
    iteration: int
    asked_bytes: int
    cap_bytes: int


# About the node or a device: no RankTag, their own fields say which.

@dataclass(frozen=True, kw_only=True)
class DrainRefused(Record):
    """A new rank (`job`, `job_name`, `rank_refused`) was refused on drained `device`: it trains unscheduled."""

    name: ClassVar[EventName] = EventName.DRAIN_REFUSED
    device: int
    job: str
    job_name: str
    rank_refused: int


@dataclass(frozen=True, kw_only=True)
class Policy(Record):
    """The operator (`caller`) switched the policy from `old` to `new`; `protect`: the isolation target
    from then on (on lines written since crossoverd records it)."""

    name: ClassVar[EventName] = EventName.POLICY
    old: str
    new: str
    protect: float | None = None
    caller: str


@dataclass(frozen=True, kw_only=True)
class Drain(Record):
    """The operator (`caller`) drained `device`: new ranks go elsewhere or are refused."""

    name: ClassVar[EventName] = EventName.DRAIN
    device: int
    caller: str


@dataclass(frozen=True, kw_only=True)
class Evict(Record):
    """The operator (`caller`) took `device` back from its holders (-1: none named) and/or closed `job`'s
    sessions (empty: none named); `touched`: the ranks it touched."""

    name: ClassVar[EventName] = EventName.EVICT
    device: int
    job: str
    touched: int
    caller: str


@dataclass(frozen=True, kw_only=True)
class Sharing(Record):
    """The adaptive rule's verdict on `device` changed: `mode` (scheduled, unscheduled), `reason`, and the
    measured `score` (None: not measured)."""

    name: ClassVar[EventName] = EventName.SHARING
    device: int
    mode: str
    reason: str
    score: float | None


@dataclass(frozen=True, kw_only=True)
class Isolation(Record):
    """`device`'s isolation controller changed its lower classes' `budget`, or began a `window` (solo, shared);
    `reference_s`, `current_s`: its protected job's iteration time alone and now (None: not measured)."""

    name: ClassVar[EventName] = EventName.ISOLATION
    device: int
    window: str
    budget: float
    reference_s: float | None
    current_s: float | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class Adapt(Record):
    """The operator (`caller`) switched the adaptive rule `on` or off."""

    name: ClassVar[EventName] = EventName.ADAPT
    on: bool
    caller: str


@dataclass(frozen=True, kw_only=True)
class HandoverSwitch(Record):
    """The operator (`caller`) switched the hand-over on the device `on` or off."""

    name: ClassVar[EventName] = EventName.HANDOVER_SWITCH
    on: bool
    caller: str


@dataclass(frozen=True, kw_only=True)
class JobClassSet(Record):
    """The operator (`caller`) set `job`'s class here: `priority`, `weight`."""

    name: ClassVar[EventName] = EventName.JOB_CLASS_SET
    job: str
    priority: str
    weight: float
    caller: str
