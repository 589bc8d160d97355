"""`crossover`: look at and steer the node's crossoverd, and read its event logs.

Results go to stdout (a table, or versioned JSON with --json); diagnostics go
to stderr as one line. Exit codes are named in `ExitCode`. One module per
command; the daemon's answers come through `crossover.client.admin.AdminClient`.
"""
from __future__ import annotations

import sys
import textwrap

import click

from crossover.client.cli._common import ExitCode, OneLineGroup
from crossover.client.cli.devices import drain, resume
from crossover.client.cli.evict import evict
from crossover.client.cli.job_class import priority, share
from crossover.client.cli.jobs import jobs
from crossover.client.cli.policy import policy
from crossover.client.cli.queue import queue
from crossover.client.cli.stats import stats
from crossover.client.cli.timeline import timeline
from crossover.protos import STEERING_COMMANDS_TEXT

__all__ = ["ExitCode", "main"]


def _version() -> str:
    """The installed distribution's version, else the package's own (a checkout run in place)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("horovod-crossover")
    except PackageNotFoundError:
        from crossover import __version__

        return __version__


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"crossover {_version()}")
        ctx.exit()


_HELP = f"""Inspect and steer the Crossover daemon of this node.

Each device (GPU, or CPU core under --cpu-devices) has a queue: the rank
holding it computes; the others wait in grant order or are in their
allreduce. Start with `crossover queue`. `crossover stats` and
`crossover timeline` read the daemon's --event-log files instead.

\b
Exit codes: 0 ok, 1 error, 2 usage, 3 daemon unreachable,
            4 request refused, 5 token refused, 6 not allowed
{textwrap.fill(f"({STEERING_COMMANDS_TEXT} go to the daemon's admin socket, or need its admin token over TCP).",
               62, initial_indent=" " * 12, subsequent_indent=" " * 12)}
"""


@click.group("crossover", cls=OneLineGroup, help=_HELP,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and exit.")
def main() -> None:
    """The `crossover` command: its subcommands follow."""


for _command in (queue, jobs, policy, drain, resume, priority, share, evict, timeline, stats):
    main.add_command(_command)


if __name__ == "__main__":
    sys.exit(main())
