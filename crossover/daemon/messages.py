"""What the scheduler posts to a rank's session; the stream's edge turns each into a Directive."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from crossover.daemon.policies.classes import JobClass
from crossover.daemon.policies.memory import MemoryCap

__all__ = ["AliveMsg", "ClassMsg", "CloseMsg", "GrantMsg", "LeaseMsg", "Message", "PageMsg", "PolicyMsg", "PreemptMsg",
           "ShareMsg"]


@dataclass(frozen=True)
class GrantMsg:
    """The rank may compute: the answer to its request `seq` for `iteration`, after `waited_s`."""

    seq: int
    iteration: int
    waited_s: float
    after_page: int = 0  # the device's previous holder released early: start after its page reaches the ticket
    after_ticket: int = 0


@dataclass(frozen=True)
class PolicyMsg:
    """The node's policy changed; `blocks` says whether ranks must wait for grants."""

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
    handover: bool = False  # every rank on the device ends its turns on the device
    outranked: bool = False  # a rank of a higher class shares the device
    memory_cap: MemoryCap = MemoryCap()  # what the rank may hold on the device (see `policies.memory`)


@dataclass(frozen=True)
class AliveMsg:
    """The answer to a heartbeat: the daemon still reads and decides."""


@dataclass(frozen=True)
class ClassMsg:
    """The session's job's class on this node; `note` says why a class the rank asked for was not given."""

    cls: JobClass
    note: str = ""


@dataclass(frozen=True)
class PreemptMsg:
    """A higher-class rank waits for the session's device: yield it at the next gradient."""


@dataclass(frozen=True)
class PageMsg:
    """A turn page for the session (`handover`), with its descriptor: the rank's own, or one it may wait on."""

    page: int
    fd: int
    own: bool


@dataclass(frozen=True)
class CloseMsg:
    """Ends a session's stream; `error` set means the rank sent something invalid."""

    reason: str
    error: Exception | None = None


Message = Union[GrantMsg, PolicyMsg, LeaseMsg, ShareMsg, AliveMsg, ClassMsg, PreemptMsg, PageMsg, CloseMsg]
