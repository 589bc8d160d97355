"""What every `crossover` command shares: exit codes, the one-line failure, the daemon options and output."""
from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, TypeVar

import click
from rich.console import Console

from crossover.client.admin import (
    AdminClient,
    AdminError,
    BadSetting,
    DaemonUnreachable,
    NotAllowed,
    TokenRefused,
)
from crossover.client.cli import formatting
from crossover.client.replies import Reply
from crossover.protos import default_socket_path

__all__ = ["MAX_DEVICE", "Daemon", "ExitCode", "Fail", "OneLineGroup", "console", "finite", "not_nan",
           "with_daemon_options"]

MAX_DEVICE = 2**31 - 1  # the wire's int32

R = TypeVar("R", bound=Reply)


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1          # unexpected failure
    USAGE = 2          # bad command line (click's own code)
    UNREACHABLE = 3    # no daemon answered
    REFUSED = 4        # the daemon rejected the request (invalid, unknown device/policy, ...)
    UNAUTHENTICATED = 5
    FORBIDDEN = 6      # an admin call this user (or token) may not make


class Fail(click.ClickException):
    """A command's failure: one line on stderr, and its exit code."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = int(code)  # type: ignore[misc]  # click declares it per class; ours vary per error

    def show(self, file: Any = None) -> None:
        click.echo(f"crossover: {self.format_message()}", err=True)


class Usage(click.UsageError):
    """A usage error as one line: what is wrong, and where the command's help is."""

    def show(self, file: Any = None) -> None:
        where = f" (see `{self.ctx.command_path} --help`)" if self.ctx is not None else ""
        prog = self.ctx.find_root().info_name if self.ctx is not None else "crossover"
        click.echo(f"{prog}: {self.format_message()}{where}", err=True)


_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+|inf|nan)", re.IGNORECASE)


def _as_one_line(exc: click.UsageError) -> click.UsageError:
    """`exc` as a `Usage`. A negative number a command took for an option (`drain -1`) is told as what is
    wrong with it as the command's numeric argument."""
    ctx = exc.ctx
    if isinstance(exc, click.NoSuchOption) and ctx is not None and _NUMBER.fullmatch(exc.option_name):
        numeric = [p for p in ctx.command.params if isinstance(p, click.Argument)
                   and isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType))]
        if numeric:
            try:
                numeric[-1].type.convert(exc.option_name, numeric[-1], ctx)
            except click.BadParameter as bad:
                exc = bad
    return Usage(exc.format_message(), ctx)


@contextmanager
def _one_line_usage() -> Iterator[None]:
    try:
        yield
    except click.UsageError as exc:
        if isinstance(exc, Usage) or type(exc).show is not click.UsageError.show:  # e.g. help shown for no command
            raise
        raise _as_one_line(exc) from None


class OneLineGroup(click.Group):
    """The `crossover` group: a usage error of any command is one line on stderr, not click's four."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        with _one_line_usage():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_usage():
            return super().invoke(ctx)


_EXIT_CODES: list[tuple[type[AdminError], ExitCode]] = [
    (DaemonUnreachable, ExitCode.UNREACHABLE),
    (TokenRefused, ExitCode.UNAUTHENTICATED),
    (NotAllowed, ExitCode.FORBIDDEN),
    (BadSetting, ExitCode.USAGE),
]


def _failure(exc: AdminError) -> Fail:
    code = next((code for cls, code in _EXIT_CODES if isinstance(exc, cls)), ExitCode.REFUSED)
    return Fail(str(exc), code)


def console() -> Console:
    """Piped output gets a fixed, readable width instead of rich's 80-column fallback."""
    return Console(width=None if sys.stdout.isatty() else 140)


class Daemon:
    """The daemon a command talks to, and how the command prints what it answers."""

    def __init__(self, client: AdminClient, as_json: bool) -> None:
        self.client = client
        self.as_json = as_json

    def ask(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`call(*args, **kwargs)` on the AdminClient; its failure becomes the command's exit code."""
        try:
            return call(*args, **kwargs)
        except AdminError as exc:
            raise _failure(exc) from None

    def emit(self, kind: str, reply: R, render: Callable[[R], Any]) -> None:
        """Print the daemon's `reply` (a `crossover.client.replies` record): as versioned JSON with --json, else
        as `render` draws it."""
        if self.as_json:
            click.echo(json.dumps(formatting.to_json(kind, reply), indent=2, sort_keys=True))
        else:
            console().print(render(reply))

    @classmethod
    def from_options(cls, kw: dict[str, Any]) -> Daemon:
        """The daemon named by the options `with_daemon_options` added (popped from `kw`)."""
        token, token_file, address, tls_ca = kw.pop("token"), kw.pop("token_file"), kw.pop("address"), kw.pop("tls_ca")
        if token_file:
            if token:
                raise click.UsageError("give --token or --token-file, not both")
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise click.UsageError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
        socket = kw.pop("socket")
        if address:
            _check_address(address)
        elif not socket:
            raise click.BadParameter("is empty: give the daemon's socket path (or --address HOST:PORT)",
                                     param_hint="'--socket'")
        if address and token and not tls_ca:
            click.echo(f"crossover: warning: sending the token to {address} over plain TCP (no --tls-ca): anyone "
                       "on the way can read it", err=True)
        client = AdminClient(socket, address, token=token or "", tls_ca=tls_ca or "", timeout=kw.pop("timeout"),
                             command=click.get_current_context().command_path)
        return cls(client, kw.pop("as_json"))


def _check_address(address: str) -> None:
    """`HOST:PORT` with a host and a port gRPC can dial (1..65535); a usage error names what is not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise click.BadParameter(f"{address!r} is not HOST:PORT with a port in 1..65535", param_hint="'--address'")


def finite(_ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value != value:  # NaN passes every range comparison
        raise click.BadParameter("must be a number of seconds, not nan", param=param)
    return value


def not_nan(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A number option's or argument's callback: NaN passes click's range checks, so it is refused here."""
    if value is not None and value != value:
        raise click.BadParameter("nan is not a number", param=param)
    return value


_DAEMON_OPTIONS = [
    click.option("--socket", default=lambda: default_socket_path(client=True),
                 show_default="$CROSSOVER_SOCKET, else your own daemon's, else the node's /run/crossover one",
                 help="Unix socket of the daemon."),
    click.option("--address", envvar="CROSSOVER_ADDRESS", help="host:port of a TCP daemon (overrides --socket)."),
    click.option("--token", envvar="CROSSOVER_TOKEN", help="Token for a TCP daemon [env CROSSOVER_TOKEN]; `ps` "
                 "shows it: prefer --token-file."),
    click.option("--token-file", type=click.Path(dir_okay=False),
                 help="Read the token for a TCP daemon from this file (the admin token, for steering over TCP)."),
    click.option("--tls-ca", envvar="CROSSOVER_TLS_CA", type=click.Path(dir_okay=False),
                 help="CA certificate (PEM) to verify a TLS daemon at --address [env CROSSOVER_TLS_CA]."),
    click.option("--json", "as_json", is_flag=True, help="Print versioned JSON instead of a table."),
    click.option("--timeout", type=click.FloatRange(0.01, 600), default=3.0, show_default=True,
                 callback=finite, help="Seconds to wait for the daemon."),
]


def with_daemon_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options that name a daemon and the output format (`Daemon.from_options` reads them)."""
    for opt in reversed(_DAEMON_OPTIONS):
        fn = opt(fn)
    return fn
