"""`crossover queue`: each device's holder, waiting ranks, phases and timings, once or refreshed."""
from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from crossover.client.cli import formatting
from crossover.client.cli._common import MAX_DEVICE, Daemon, finite, with_daemon_options
from crossover.client.replies import QueueState

__all__ = ["queue"]


@click.command()
@with_daemon_options
@click.option("--device", type=click.IntRange(-1, MAX_DEVICE), default=-1, help="Only this device (-1: all).")
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C; piped, print one snapshot per refresh "
              "(with --json, one JSON object per line).")
@click.option("--interval", type=click.FloatRange(0.1, 60), default=1.0, show_default=True, callback=finite,
              help="Seconds between refreshes with --watch.")
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
def queue(device: int, watch: bool, interval: float, wide: bool, **kw: Any) -> None:
    """Show each device's holder, waiting ranks, phases and timings.

    \b
    Columns: phase (compute, waiting, comm, other; suspended: silent past
    the heartbeat timeout, out of the order until it speaks), iter (the
    rank's iteration), comp ms / comm ms (mean phase lengths), wait (share
    of the rank's time spent waiting for grants), hand-over (device: the
    rank ends its turns on its device; cpu: its CPU waits for the device
    first), cpu% and rss (psutil), gpu mem (NVML), user (the rank's, as the
    kernel names it; - when not known). A terminal too narrow for all of
    them loses pid, hand-over, rss, gpu mem,
    cpu%, user, comm ms and iter, in that order (--wide keeps them).
    """
    daemon = Daemon.from_options(kw)

    def fetch() -> QueueState:
        return daemon.ask(daemon.client.queue, device)

    def render(state: QueueState) -> Group:
        head = Text.assemble("node ", formatting.shown(state.node), f"  policy {state.policy}  up {state.uptime_s:.0f}s"
                             f"  streams {state.connections}/{state.max_connections}")
        width = None if wide or not sys.stdout.isatty() else shutil.get_terminal_size().columns
        return Group(head, *formatting.queue_tables(state, width))

    if not watch:
        daemon.emit("queue", fetch(), render)
        return
    try:
        if daemon.as_json:
            while True:
                click.echo(json.dumps(formatting.to_json("queue", fetch()), sort_keys=True))
                time.sleep(interval)
        if not sys.stdout.isatty():  # a pipe or a file: a frame drawn in place would only show at the end
            console = Console(width=140)
            while True:
                console.print(render(fetch()))
                console.print()
                sys.stdout.flush()
                time.sleep(interval)
        with Live(render(fetch()), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(fetch()), refresh=True)
    except KeyboardInterrupt:
        pass
