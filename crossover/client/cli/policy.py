"""`crossover policy`: show the node's policy, or switch it, its adapting and its hand-over."""
from __future__ import annotations

import textwrap
from typing import Any

import click

from crossover.client.cli._common import Daemon, with_daemon_options
from crossover.protos import POLICIES

__all__ = ["policy"]

_HELP = "Show the policy, or switch to NAME (ranks waiting are re-queued under it).\n\n\b\n" + "\n".join(
    textwrap.fill(what, 76, initial_indent=f"{name:<12} ", subsequent_indent=" " * 13)
    for name, what in POLICIES.items()) + (
    "\n\nWith --adapt each device measures, in windows aligned on the wall clock, whether its "
    "grants make its jobs faster, and runs unscheduled where they do not (`crossover queue` says "
    "which and why); --no-adapt grants everywhere. The daemon starts as crossoverd --adapt says. "
    "--no-handover makes every rank wait for its device on its CPU before it releases; --handover "
    "lets ranks that can end their turns on their device again (docs/handover.md). --protect sets the share "
    "of its speed alone that the highest class on a device keeps beside lower ones (crossoverd --protect; 0 "
    "turns the isolation controller off, docs/priorities.md); the policy starts afresh under it.")


@click.command(help=_HELP)
@with_daemon_options
@click.argument("name", required=False)
@click.option("--adapt/--no-adapt", default=None,
              help="Measure per device whether grants pay and run unscheduled where they do not (or stop).")
@click.option("--handover/--no-handover", default=None,
              help="Let ranks that can end their turns on their device (or make every rank's CPU wait for it).")
@click.option("--protect", type=click.FloatRange(0.0, 1.0), default=None, metavar="SHARE",
              help="The share of its speed alone the highest class keeps (0..1; 0 turns the controller off).")
def policy(name: str | None, adapt: bool | None, handover: bool | None, protect: float | None, **kw: Any) -> None:
    daemon = Daemon.from_options(kw)
    if name or adapt is not None or handover is not None or protect is not None:
        reply = daemon.ask(daemon.client.set_policy, name or "", adapt=adapt, handover=handover, protect=protect)
    else:
        reply = daemon.ask(daemon.client.policy)
    daemon.emit("policy", reply, lambda p: f"policy {p.name}, adapt {'on' if p.adapt else 'off'}, "
                                           f"hand-over {'on' if p.handover else 'off'}, protect {p.protect:g} "
                                           f"(available: {', '.join(p.available)})")
