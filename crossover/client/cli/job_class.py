"""`crossover priority` and `crossover share`: a job's class and its weight within it, on this node."""
from __future__ import annotations

from typing import Any

import click

from crossover.client.cli._common import Daemon, not_nan, with_daemon_options
from crossover.client.cli.formatting import shown
from crossover.client.replies import JobState
from crossover.protos.priority import NAMES

__all__ = ["priority", "share"]


def _said(job: str, reply: JobState) -> str:
    """The reply as a line that names the job as the operator typed it (and its id, where that was its name)."""
    which = shown(job).plain + ("" if job == reply.job_id else f" (id {reply.job_id[:12]})")
    return f"job {which}: {reply.priority}, weight {reply.weight:g} on this node"


@click.command()
@with_daemon_options
@click.argument("job")
@click.argument("klass", metavar="CLASS", type=click.Choice(NAMES, case_sensitive=False))
@click.option("--weight", type=click.FloatRange(0.01, 100), callback=not_nan,
              help="Also set its weight within the class.")
def priority(job: str, klass: str, weight: float | None, **kw: Any) -> None:
    """Set JOB's priority CLASS on this node (high, normal, low); JOB is its id or name.

    A higher class computes first; a lower one only fills the gaps a higher job leaves
    (its allreduces), yields when a higher rank asks, and keeps a guaranteed share
    (crossoverd --guard-share). Run it on every node the job spans: each daemon decides
    alone. The event log records who set it.

    \b
    crossover priority prod high
    crossover priority sweep-17 low --weight 2
    """
    daemon = Daemon.from_options(kw)
    daemon.emit("job_class", daemon.ask(daemon.client.set_job_class, job, klass.lower(), weight),
                lambda d: _said(job, d))


@click.command()
@with_daemon_options
@click.argument("job")
@click.argument("weight", type=click.FloatRange(0.01, 100), callback=not_nan)
def share(job: str, weight: float, **kw: Any) -> None:
    """Set JOB's WEIGHT within its class on this node: waiting jobs of one class share the device by weight."""
    daemon = Daemon.from_options(kw)
    daemon.emit("job_class", daemon.ask(daemon.client.set_job_class, job, None, weight), lambda d: _said(job, d))
