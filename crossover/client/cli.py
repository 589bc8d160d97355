"""`crossover`: look at and steer the node's crossoverd.

Results go to stdout (a table, or versioned JSON with --json); diagnostics go
to stderr as one line. Exit codes are named in `ExitCode`.
"""
from __future__ import annotations

import enum
import json
import math
import os
import pwd
import shutil
import socket
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NoReturn

import click
import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from crossover.client import event_intervals, event_views, formatting
from crossover.client.transport import channel_for, untrusted_socket
from crossover.protos import (
    POLICIES,
    PROTOCOL_VERSION,
    STEERING_CALLS,
    USER_METADATA_KEY,
    admin_socket_path,
    default_socket_path,
    switches,
)
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.event_file import read_jsonl
from crossover.protos.priority import NAMES, name_of, to_wire

__all__ = ["main", "ExitCode"]


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1          # unexpected failure
    USAGE = 2          # bad command line (click's own code)
    UNREACHABLE = 3    # no daemon answered
    REFUSED = 4        # the daemon rejected the request (invalid, unknown device/policy, ...)
    UNAUTHENTICATED = 5
    FORBIDDEN = 6      # an admin call this user (or token) may not make


class _Fail(click.ClickException):
    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = int(code)  # type: ignore[misc]  # click declares it per class; ours vary per error

    def show(self, file: Any = None) -> None:
        click.echo(f"crossover: {self.format_message()}", err=True)


def _unreachable(target: str, code: grpc.StatusCode, timeout: float) -> str:
    """One line: which daemon was tried, what is wrong with it (not running, or answering not at all), what next."""
    where = "set CROSSOVER_SOCKET or pass --socket (or --address HOST:PORT)"
    if not target.startswith("unix://"):
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"crossoverd at {target} did not answer within {timeout:g} s (frozen, overloaded or filtered)"
        return f"no crossoverd answers at {target} (not running, or unreachable from here); check --address"
    path = target[len("unix://"):]
    if not os.path.exists(path):
        return f"no daemon socket at {path}: crossoverd is not running there; start it, or {where}"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return f"{path} is a stale socket (nobody listens): crossoverd is not running; start it, or {where}"
    except OSError as exc:
        return f"cannot connect to {path}: {exc.strerror or exc}; {where}"
    finally:
        probe.close()
    return (f"crossoverd at {path} accepts connections but did not answer within {timeout:g} s: it is frozen "
            "(stopped: `ps -o stat` of its pid shows T) or overloaded")


def _rpc_error(exc: grpc.RpcError, target: str, timeout: float = 5.0) -> NoReturn:
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        raise _Fail(_unreachable(target, code, timeout), ExitCode.UNREACHABLE)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        raise _Fail(f"daemon refused the token: {exc.details()}", ExitCode.UNAUTHENTICATED)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        raise _Fail(f"not allowed: {exc.details()}", ExitCode.FORBIDDEN)
    raise _Fail(f"{exc.details()} ({code.name})", ExitCode.REFUSED)


def _user() -> str:
    """This process's user name, for the daemon's record of a steering call."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


class _Ctx:
    def __init__(self, socket: str, address: str | None, token: str | None, as_json: bool, timeout: float,
                 tls_ca: str | None = None) -> None:
        self.socket = None if address else socket
        self.target = address or f"unix://{socket}"
        self.token = token or ""
        self.tls_ca = tls_ca or ""
        self.as_json = as_json
        self.timeout = timeout
        self._channel: grpc.Channel | None = None

    def call(self, method: str, request: Any) -> Any:
        if method in STEERING_CALLS and self.socket is not None:
            self._use_admin_socket(method)
        if self._channel is None:
            untrusted = untrusted_socket(self.target)
            if untrusted:
                raise _Fail(untrusted, ExitCode.FORBIDDEN)
            try:
                self._channel, self._md = channel_for(self.target, self.token, self.tls_ca)
            except OSError as exc:
                raise _Fail(f"cannot read --tls-ca {self.tls_ca}: {exc.strerror}", ExitCode.USAGE) from None
        stub = pb_grpc.AdminStub(self._channel)
        metadata = list(self._md)
        if method in STEERING_CALLS:
            metadata.append((USER_METADATA_KEY, _user()))
        try:
            return getattr(stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            _rpc_error(exc, self.target, self.timeout)

    def _use_admin_socket(self, method: str) -> None:
        assert self.socket is not None
        path = admin_socket_path(self.socket)
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            raise _Fail(f"{method} needs the daemon's admin socket {path}, which this user may not open "
                        "(it belongs to the daemon's user, or to crossoverd --admin-group)", ExitCode.FORBIDDEN)
        self.target = f"unix://{path}"

    def emit(self, kind: str, message: Any, render: Callable[[dict[str, Any]], Any]) -> None:
        data = formatting.to_json(kind, message)
        if self.as_json:
            click.echo(json.dumps(data, indent=2, sort_keys=True))
        else:
            # Piped output gets a fixed, readable width instead of rich's 80-column fallback.
            Console(width=None if sys.stdout.isatty() else 140).print(render(data))


_MAX_DEVICE = 2**31 - 1  # the wire's int32


def _finite(_ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value != value:  # NaN passes every range comparison
        raise click.BadParameter("must be a number of seconds, not nan", param=param)
    return value


_common = [
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
                 callback=_finite, help="Seconds to wait for the daemon."),
]


def _with_common(fn: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(_common):
        fn = opt(fn)
    return fn


def _ctx(kw: dict[str, Any]) -> _Ctx:
    token, token_file, address, tls_ca = kw.pop("token"), kw.pop("token_file"), kw.pop("address"), kw.pop("tls_ca")
    if token_file:
        if token:
            raise click.UsageError("give --token or --token-file, not both")
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise click.UsageError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
    if address and token and not tls_ca:
        click.echo(f"crossover: warning: sending the token to {address} over plain TCP (no --tls-ca): anyone "
                   "on the way can read it", err=True)
    return _Ctx(kw.pop("socket"), address, token, kw.pop("as_json"), kw.pop("timeout"), tls_ca)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and exit.")
def main() -> None:
    """Inspect and steer the Crossover daemon of this node.

    Each device (GPU, or CPU core under --cpu-devices) has a queue: the rank
    holding it computes; the others wait in grant order or are in their
    allreduce. Start with `crossover queue`. `crossover stats` and
    `crossover timeline` read the daemon's --event-log files instead.

    \b
    Exit codes: 0 ok, 1 error, 2 usage, 3 daemon unreachable,
                4 request refused, 5 token refused, 6 not allowed
                (policy, drain and resume go to the daemon's admin socket).
    """


@main.command()
@_with_common
@click.option("--device", type=click.IntRange(-1, _MAX_DEVICE), default=-1, help="Only this device (-1: all).")
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C; piped, print one snapshot per refresh "
              "(with --json, one JSON object per line).")
@click.option("--interval", type=click.FloatRange(0.1, 60), default=1.0, show_default=True, callback=_finite,
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
    ctx = _ctx(kw)
    req = pb.QueueRequest(protocol_version=PROTOCOL_VERSION, device=device)

    def render(d: dict[str, Any]) -> Group:
        head = Text.assemble("node ", formatting.shown(d["node"]), f"  policy {d['policy']}  up {d['uptime_s']:.0f}s  "
                             f"streams {d['connections']}/{d['max_connections']}")
        width = None if wide or not sys.stdout.isatty() else shutil.get_terminal_size().columns
        return Group(head, *formatting.queue_tables(d, width))

    if not watch:
        ctx.emit("queue", ctx.call("GetQueue", req), render)
        return
    try:
        if ctx.as_json:
            while True:
                click.echo(json.dumps(formatting.to_json("queue", ctx.call("GetQueue", req)), sort_keys=True))
                time.sleep(interval)
        if not sys.stdout.isatty():  # a pipe or a file: a frame drawn in place would only show at the end
            console = Console(width=140)
            while True:
                console.print(render(formatting.to_json("queue", ctx.call("GetQueue", req))))
                console.print()
                sys.stdout.flush()
                time.sleep(interval)
        with Live(render(formatting.to_json("queue", ctx.call("GetQueue", req))), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(formatting.to_json("queue", ctx.call("GetQueue", req))), refresh=True)
    except KeyboardInterrupt:
        pass


@main.command()
@_with_common
def jobs(**kw: Any) -> None:
    """List the jobs with ranks on this node."""
    ctx = _ctx(kw)
    ctx.emit("jobs", ctx.call("ListJobs", pb.JobsRequest(protocol_version=PROTOCOL_VERSION)), formatting.jobs_table)


_POLICY_HELP = "Show the policy, or switch to NAME (ranks waiting are re-queued under it).\n\n\b\n" + "\n".join(
    textwrap.fill(what, 76, initial_indent=f"{name:<12} ", subsequent_indent=" " * 13)
    for name, what in POLICIES.items())


_POLICY_HELP += ("\n\nWith --adapt each device measures, in windows aligned on the wall clock, whether its "
                 "grants make its jobs faster, and runs unscheduled where they do not (`crossover queue` says "
                 "which and why); --no-adapt grants everywhere. The daemon starts as crossoverd --adapt says. "
                 "--no-handover makes every rank wait for its device on its CPU before it releases; --handover "
                 "lets ranks that can end their turns on their device again (docs/handover.md).")


@main.command(help=_POLICY_HELP)
@_with_common
@click.argument("name", required=False)
@click.option("--adapt/--no-adapt", default=None,
              help="Measure per device whether grants pay and run unscheduled where they do not (or stop).")
@click.option("--handover/--no-handover", default=None,
              help="Let ranks that can end their turns on their device (or make every rank's CPU wait for it).")
def policy(name: str | None, adapt: bool | None, handover: bool | None, **kw: Any) -> None:
    ctx = _ctx(kw)
    req = pb.PolicyRequest(protocol_version=PROTOCOL_VERSION, name=name or "", adapt=switches.to_wire(adapt),
                           handover=switches.to_wire(handover))
    reply = ctx.call("SetPolicy" if name or adapt is not None or handover is not None else "GetPolicy", req)
    ctx.emit("policy", reply, lambda d: f"policy {d['name']}, adapt {'on' if d.get('adapt') else 'off'}, "
                                        f"hand-over {'on' if d.get('handover') else 'off'} "
                                        f"(available: {', '.join(d['available'])})")



def _device_cmd(method: str, verb: str) -> Callable[..., None]:
    def cmd(device: int, **kw: Any) -> None:
        ctx = _ctx(kw)
        reply = ctx.call(method, pb.DeviceRequest(protocol_version=PROTOCOL_VERSION, device=device))
        ctx.emit(verb, reply, lambda d: f"device {d['device']} {'draining' if d['draining'] else 'accepting ranks'}")

    return cmd


main.command("drain", help="Stop placing new ranks on DEVICE; ranks already there run to completion.")(
    _with_common(click.argument("device", type=click.IntRange(0, _MAX_DEVICE))(_device_cmd("Drain", "drain"))))
main.command("resume", help="Accept new ranks on DEVICE again.")(
    _with_common(click.argument("device", type=click.IntRange(0, _MAX_DEVICE))(_device_cmd("Resume", "resume"))))


def _class_line(d: dict[str, Any]) -> str:
    name = name_of(str(d.get("priority", ""))) or "normal"
    return f"job {d.get('job_id', '')[:12]}: {name}, weight {d.get('weight', 1.0):g} on this node"


@main.command()
@_with_common
@click.argument("job")
@click.argument("klass", metavar="CLASS", type=click.Choice(NAMES, case_sensitive=False))
@click.option("--weight", type=click.FloatRange(0.01, 100), help="Also set its weight within the class.")
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
    ctx = _ctx(kw)
    reply = ctx.call("SetJobClass", pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job=job,
                                                       priority=to_wire(klass.lower()), weight=weight or 0.0))
    ctx.emit("job_class", reply, _class_line)


@main.command()
@_with_common
@click.argument("job")
@click.argument("weight", type=click.FloatRange(0.01, 100))
def share(job: str, weight: float, **kw: Any) -> None:
    """Set JOB's WEIGHT within its class on this node: waiting jobs of one class share the device by weight."""
    ctx = _ctx(kw)
    reply = ctx.call("SetJobClass", pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job=job, weight=weight))
    ctx.emit("job_class", reply, _class_line)


@main.command()
@_with_common
@click.argument("device", type=click.IntRange(0, _MAX_DEVICE), required=False)
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
    ctx = _ctx(kw)
    reply = ctx.call("Evict", pb.EvictRequest(protocol_version=PROTOCOL_VERSION,
                                              device=-1 if device is None else device, job=job))
    ctx.emit("evict", reply, lambda d: "\n".join(d.get("done") or ["nothing to evict"]))


def _seconds(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter("must be a finite number of seconds", param=param)
    return value


_log_options = [
    click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)),
    click.option("--since", type=float, callback=_seconds, metavar="SECONDS",
                 help="Start this many seconds after the first event (negative: before the last one)."),
    click.option("--until", type=float, callback=_seconds, metavar="SECONDS",
                 help="End this many seconds after the first event (negative: before the last one)."),
    click.option("--job", "job_names", multiple=True, metavar="NAME",
                 help="Only this job, by name or id (repeat for more)."),
]


def _with_log_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(_log_options):
        fn = opt(fn)
    return fn


class _Selection:
    """The phases of the chosen jobs in the chosen window of the given logs."""

    def __init__(self, files: Sequence[Path], since: float | None, until: float | None,
                 job_names: Sequence[str]) -> None:
        unique: dict[Path, Path] = {}
        for path in files:
            unique.setdefault(path.resolve(), path)  # a file named twice is read once
        logs = [_read_log(path) for path in unique.values()]
        events = event_intervals.merge_logs(logs)
        self.log = event_intervals.read_phases(events)
        self.policy_changes = event_intervals.policy_changes(events)
        self.operator_marks = event_intervals.operator_marks(events)
        try:
            self.jobs = event_intervals.select_jobs(self.log, job_names)
        except event_intervals.UnknownJob as exc:
            raise _Fail(str(exc), ExitCode.USAGE) from None
        self.since, self.until = event_intervals.window(self.log, since, until)
        span = self.log.last - self.log.first
        if self.since >= self.until:
            raise _Fail(f"empty window: {self.since - self.log.first:.1f} s to {self.until - self.log.first:.1f} s "
                        f"(the log spans 0 to {span:.1f} s)", ExitCode.USAGE)
        self.devices = sorted({iv.device_key for iv in self.log.intervals if iv.job in self.jobs})
        self.intervals = event_intervals.clip((iv for iv in self.log.intervals if iv.job in self.jobs),
                                              self.since, self.until)
        if not self.intervals:
            whose = f" of {', '.join(job_names)}" if job_names else ""
            raise _Fail(f"no phases{whose} between {self.since - self.log.first:.1f} s and "
                        f"{self.until - self.log.first:.1f} s (the log spans 0 to {span:.1f} s)", ExitCode.ERROR)


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise _Fail(f"no such file: {path}", ExitCode.USAGE)
    try:
        events = [e for e in read_jsonl(path) if isinstance(e, dict) and "event" in e
                  and isinstance(e.get("t"), (int, float))]
    except (OSError, ValueError) as exc:
        raise _Fail(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", ExitCode.ERROR) from None
    if not events:
        raise _Fail(f"{path} holds no crossoverd events (is it a crossoverd --event-log file?)", ExitCode.ERROR)
    return events


@main.command()
@_with_log_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default="timeline.png",
              show_default=True, help="PNG file to write.")
@click.option("--title", help="Title above the picture (default: the files and the window).")
@click.option("--json", "as_json", is_flag=True, help="Print what was drawn as versioned JSON (the PNG's path, the "
              "window, the devices and the marks) instead of the path alone.")
def timeline(files: tuple[Path, ...], since: float | None, until: float | None, job_names: tuple[str, ...],
             output: Path, title: str | None, as_json: bool) -> None:
    """Draw who computed, communicated and waited on each device, from event logs.

    FILES are crossoverd --event-log files, one per node; their clocks are
    aligned by wall time. One band per node and device, one row per rank on
    it: compute solid, allreduce hatched, waiting for a grant pale, a rank
    suspended (silent) dotted red; dashed lines mark policy switches,
    drains, resumes and evictions. Needs matplotlib
    (pip install 'horovod-crossover[plots]').
    """
    if not output.parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist (create it, or write elsewhere)",
                                 param_hint="'-o' / '--output'")
    sel = _Selection(files, since, until, job_names)
    if title is None:
        title = (f"{', '.join(p.name for p in files)}: {sel.since - sel.log.first:.1f} s to "
                 f"{sel.until - sel.log.first:.1f} s" + (f", jobs {', '.join(job_names)}" if job_names else ""))
    marks = sorted([(t, f"policy {p}") for t, p in sel.policy_changes] + sel.operator_marks)
    try:
        path = event_views.draw_timeline(sel.intervals, sel.since, sel.until, output, devices=sel.devices,
                                         marks=marks, title=title, origin=sel.log.first)
    except ImportError as exc:
        raise _Fail(f"timeline needs matplotlib ({exc}): pip install 'horovod-crossover[plots]' "
                    "or pip install matplotlib", ExitCode.ERROR) from None
    except OSError as exc:
        raise _Fail(f"cannot write {output}: {exc.strerror or exc}", ExitCode.ERROR) from None
    if as_json:
        click.echo(json.dumps({"version": formatting.JSON_VERSION, "kind": "timeline", "path": str(path),
                               "window": {"since_s": sel.since - sel.log.first, "until_s": sel.until - sel.log.first},
                               "devices": [{"node": n, "device": d} for n, d in sel.devices],
                               "marks": [{"t_s": t - sel.log.first, "what": what} for t, what in marks]},
                              indent=2, sort_keys=True))
        return
    click.echo(str(path))


@main.command()
@_with_log_options
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
    sel = _Selection(files, since, until, job_names)
    result = event_intervals.compute_stats(sel.log, sel.since, sel.until, sel.jobs)
    if as_json:
        click.echo(json.dumps(event_views.stats_json(result, sel.log), indent=2, sort_keys=True))
    else:
        Console(width=None if sys.stdout.isatty() else 140).print(*event_views.stats_tables(result, sel.log))


if __name__ == "__main__":
    sys.exit(main())
