"""`crossover jobs`: the jobs with ranks on this node."""
from __future__ import annotations

from typing import Any

import click

from crossover.client.cli import formatting
from crossover.client.cli._common import Daemon, with_daemon_options

__all__ = ["jobs"]


@click.command()
@with_daemon_options
def jobs(**kw: Any) -> None:
    """List the jobs with ranks on this node."""
    daemon = Daemon.from_options(kw)
    daemon.emit("jobs", daemon.ask(daemon.client.jobs), formatting.jobs_table)
