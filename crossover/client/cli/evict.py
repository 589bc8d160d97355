"""`crossover evict`: take a device back from its holder now, or remove a job's ranks from this node."""
from __future__ import annotations

from typing import Any

import click

from crossover.client.cli._common import MAX_DEVICE, Daemon, with_daemon_options

__all__ = ["evict"]


@click.command()
@with_daemon_options
@click.argument("device", type=click.IntRange(0, MAX_DEVICE), required=False)
@click.option("--job", default="", metavar="JOB", help="Also (or only) close every session of this job (id or name).")
def evict(device: int | None, job: str, **kw: Any) -> None:
    """Take DEVICE back from the rank that holds it, now, or remove a job's ranks from this node.

    \b
    crossover evict 0            the holder of device 0 is treated as stalled; the next rank computes
    crossover evict --job hog    every session of job `hog` here is closed; its ranks train
                                 unscheduled and re-attach as new sessions (drain the device first
                                 to keep them off it)
    """
    if device is None and not job:
        raise click.UsageError("name a DEVICE or a --job to evict")
    daemon = Daemon.from_options(kw)
    daemon.emit("evict", daemon.ask(daemon.client.evict, device, job),
                lambda reply: "\n".join(reply.done or ["nothing to evict"]))
