"""Which class a rank's job gets on this node: the operator's rules, keyed by what the kernel vouches for.

A rank may only *lower* its class (`CROSSOVER_PRIORITY=low`). Raising one is the
operator's: `crossoverd --class-rule uid:1000=high` (or `gid:`, `user:`, `group:`)
gives every rank whose session-socket peer the kernel names as that user or
group at most that class (and that weight), and `crossover priority JOB CLASS`
sets one job's class outright. A rank whose user no rule names, or whose user
is not known (a rank on the gRPC stream), gets `normal`.

Pure apart from name lookups at parse time.
"""
from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass

from crossover.daemon.policies.classes import JobClass, Priority

__all__ = ["ClassRule", "ClassRules", "effective_class", "parse_rule"]


@dataclass(frozen=True)
class ClassRule:
    """`uid` or `gid` (one of them) gets at most `cls`; `text` is the rule as written."""

    text: str
    cls: JobClass
    uid: int | None = None
    gid: int | None = None


def parse_rule(text: str) -> ClassRule:
    """`uid:1000=high`, `gid:50=low`, `user:alice=high:2` (weight 2), `group:batch=low`; ValueError says
    what is wrong."""
    subject, sep, value = text.partition("=")
    kind, colon, name = subject.strip().partition(":")
    if not sep or not colon or not name:
        raise ValueError(f"class rule {text!r}: write SUBJECT=CLASS[:WEIGHT], SUBJECT one of uid:N, gid:N, "
                         "user:NAME, group:NAME")
    klass, _, weight = value.partition(":")
    cls = JobClass(Priority.parse(klass), float(weight) if weight else 1.0)
    try:
        if kind == "uid":
            return ClassRule(text, cls, uid=int(name))
        if kind == "gid":
            return ClassRule(text, cls, gid=int(name))
        if kind == "user":
            return ClassRule(text, cls, uid=pwd.getpwnam(name).pw_uid)
        if kind == "group":
            return ClassRule(text, cls, gid=grp.getgrnam(name).gr_gid)
    except KeyError:
        raise ValueError(f"class rule {text!r}: no {kind} {name!r} on this node") from None
    raise ValueError(f"class rule {text!r}: subject {kind!r} is not one of uid, gid, user, group")


class ClassRules:
    """The node's rules; the first that names a rank's user, then the first that names its group, decides."""

    def __init__(self, rules: tuple[ClassRule, ...] = ()) -> None:
        self.rules = rules

    def given(self, uid: int | None, gid: int | None) -> tuple[JobClass, str]:
        """The class a rank of this user and group is given, and the rule that gave it ("" for the default)."""
        for rule in self.rules:
            if uid is not None and rule.uid == uid:
                return rule.cls, rule.text
        for rule in self.rules:
            if gid is not None and rule.gid == gid:
                return rule.cls, rule.text
        return JobClass(), ""

    def could_give(self, priority: Priority) -> bool:
        """Whether some rule gives `priority` or higher (a rank asking for it may get it once its user is known)."""
        return any(r.cls.priority >= priority for r in self.rules)


def effective_class(asked: Priority | None, given: JobClass, by: str) -> tuple[JobClass, str]:
    """The class a rank gets: what it asked for if not above what it was given; else what it was given,
    with one line saying why."""
    if asked is None or asked == given.priority:
        return given, ""
    if asked < given.priority:
        return JobClass(asked, given.weight), ""
    why = f"the rule {by} gives this user {given.priority}" if by else "no --class-rule of this node names this user"
    return given, (f"CROSSOVER_PRIORITY={asked} refused: {why}; a class above that is the operator's "
                   f"(crossoverd --class-rule, crossover priority). Training as {given.priority}.")
