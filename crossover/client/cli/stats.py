"""`crossover stats`: per job and per device figures from event logs."""
from __future__ import annotations

import json
from pathlib import Path

import click

from crossover.client.cli import event_intervals, event_views
from crossover.client.cli._common import console
from crossover.client.cli.log_selection import Selection, with_log_options

__all__ = ["stats"]


@click.command()
@with_log_options
@click.option("--json", "as_json", is_flag=True, help="Print versioned JSON instead of tables.")
def stats(files: tuple[Path, ...], since: float | None, until: float | None, job_names: tuple[str, ...],
          as_json: bool) -> None:
    """Per job and per device figures from event logs.

    \b
    Jobs: ranks seen, iterations (compute phases a rank released in the window),
    compute and allreduce time (total, mean), wait for grants (total, mean,
    p95, max), compute share of the ranks' active time.
    Devices: busy (time some rank computed / window), grants, holders.
    Phases that cross the window's edges are cut to it.
    """
    sel = Selection(files, since, until, job_names)
    result = event_intervals.compute_stats(sel.log, sel.since, sel.until, sel.jobs)
    if as_json:
        click.echo(json.dumps(event_views.stats_json(result, sel.log), indent=2, sort_keys=True))
    else:
        console().print(*event_views.stats_tables(result, sel.log))
