"""`crossover drain` and `crossover resume`: stop and restart placing new ranks on a device."""
from __future__ import annotations

from typing import Any

import click

from crossover.client.admin import AdminClient
from crossover.client.cli._common import MAX_DEVICE, Daemon, with_daemon_options

__all__ = ["drain", "resume"]


def _device_command(name: str, call: Any, help: str) -> click.Command:  # noqa: A002 - click's own word
    def command(device: int, **kw: Any) -> None:
        daemon = Daemon.from_options(kw)
        daemon.emit(name, daemon.ask(call, daemon.client, device),
                    lambda ack: f"device {ack.device} {'draining' if ack.draining else 'accepting ranks'}")

    command.__name__ = name
    return click.command(name, help=help)(
        with_daemon_options(click.argument("device", type=click.IntRange(0, MAX_DEVICE))(command)))


drain = _device_command("drain", AdminClient.drain,
                        "Stop placing new ranks on DEVICE; ranks already there run to completion.")
resume = _device_command("resume", AdminClient.resume, "Accept new ranks on DEVICE again.")
