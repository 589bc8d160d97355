"""`crossoverd`: the per-node scheduling daemon."""
from __future__ import annotations

import grp
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click

from crossover import __version__
from crossover.daemon import event_log as event_log_file
from crossover.daemon import policies
from crossover.daemon.api import CrossoverError
from crossover.daemon.class_rules import ClassRules, parse_rule
from crossover.daemon.event_log import EventLog
from crossover.daemon.grant_payoff import PayoffSettings
from crossover.daemon.inventory import Inventory, parse_cpu_devices
from crossover.daemon.limits import StreamLimits
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.metrics import DaemonMetrics, parse_address
from crossover.daemon.policies.classes import ClassSettings
from crossover.daemon.policies.isolation import IsolationSettings
from crossover.daemon.policies.memory import MemoryRules
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.daemon.server import Daemon, Endpoints
from crossover.figures import parse_size
from crossover.protos import STEERING_COMMANDS_TEXT, default_socket_path

_log = logging.getLogger("crossover.daemon")
_MIB = 1 << 20


def _read_secret(value: str | None, file: str | None, what: str) -> str | None:
    if file:
        try:
            return Path(file).read_text().strip()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {what} file: {exc}") from None
    return value


def _group(name: str | None, flag: str) -> int | None:
    if name is None:
        return None
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise click.BadParameter(f"no group named {name!r}", param_hint=flag) from None


class _Usage(click.UsageError):
    """A usage error of crossoverd as one line: what is wrong, and where its help is."""

    def show(self, file: Any = None) -> None:
        click.echo(f"crossoverd: {self.format_message()} (see `crossoverd --help`)", err=True)


_TUNING = frozenset({
    "event_log_size", "event_log_max_mb", "event_log_backups", "max_events_per_s", "max_connections",
    "max_connections_per_user", "idle_timeout", "heartbeat_timeout", "evict_after", "overdue_factor",
    "overdue_after", "overdue_warmup", "max_hold", "lease", "adapt", "adapt_window", "guard_share", "protect",
    "session_socket", "handover", "cpu_device_memory"})
"""The flags an operator tunes rather than sets: `--help` names how many there are, `--help-all` lists them."""


_HELP_ALL = "crossoverd.help_all"


def _help_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--help-all`: the help with the tuning flags too."""
    if value and not ctx.resilient_parsing:
        ctx.meta[_HELP_ALL] = True
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


class _Command(click.Command):
    """crossoverd's command line, whose usage errors are one line on stderr instead of click's four, and
    whose help lists what an operator sets (sockets, devices, policy, classes, admin, logs); the tuning
    (liveness, overdue, adapt, limits) only with `--help-all`."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = {False: [], True: []}  # type: dict[bool, list[tuple[str, str]]]
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rows[param.name in _TUNING].append(record)
        with formatter.section("Options"):
            formatter.write_dl(rows[False])
        if ctx.meta.get(_HELP_ALL):
            with formatter.section("Tuning (defaults suit most nodes)"):
                formatter.write_dl(rows[True])
        else:
            formatter.write_paragraph()
            formatter.write_text(f"Tuning: {len(rows[True])} more flags (liveness, stalls, adapt, limits, the "
                                 "event log's size) whose defaults suit most nodes: `crossoverd --help-all`.")

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _Usage(exc.format_message(), exc.ctx) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _Usage(exc.format_message(), exc.ctx) from None


@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="crossoverd", message="%(prog)s %(version)s")
@click.option("--help-all", is_flag=True, is_eager=True, expose_value=False, callback=_help_all,
              help="Show this help with the tuning flags too, and exit.")
@click.option("--socket", "socket_path", default=default_socket_path,
              show_default="$CROSSOVER_SOCKET or a per-user path",
              help="Unix socket to serve on (created 0660, its folder 0750: the socket group may connect, "
              "only the daemon changes what is there). Ranks and `crossover` find it here.")
@click.option("--no-socket", is_flag=True, help="Serve only on --listen.")
@click.option("--listen", metavar="HOST:PORT", help="Also serve on TCP (needs --token or --token-file).")
@click.option("--token", envvar="CROSSOVER_TOKEN",
              help="Shared token TCP clients must send [env CROSSOVER_TOKEN]; `ps` shows it: prefer --token-file.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="Read the token from this file.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False),
              help=f"Read the admin token from this file: TCP calls that change state ({STEERING_COMMANDS_TEXT}) "
              "need it. Without it, TCP callers can look but not steer.")
@click.option("--socket-group", metavar="GROUP",
              help="Group that may reach the rank sockets (ranks run as its members); default: the daemon "
              "user's group.")
@click.option("--admin-group", metavar="GROUP",
              help=f"Group that may also use the admin socket SOCKET.admin ({STEERING_COMMANDS_TEXT}); default: "
              "the daemon's user (and root) alone.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate: serve TCP with TLS.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for --tls-cert.")
@click.option("--cpu-devices", metavar="N|IDS",
              help="Manage CPU cores as devices: a count (2: cores 0 and 1) or core ids (0,1 or 2-3; one core: "
              "3, or a lone 0). Without it, GPUs are found through NVML.")
@click.option("--policy", type=click.Choice(policies.available()), default=SchedulerSettings.policy, show_default=True,
              help="crossover: one job's compute phase per device at a time, served in the order jobs' allreduces "
              "ended (one order on every node), clearly shorter computes first; one job computes "
              "while another communicates. exclusive: plain FIFO. "
              "passthrough: observe only. docs/policies.md compares them.")
@click.option("--node-name", default=lambda: os.uname().nodename, show_default="hostname",
              help="Name this node reports; must be unique in the cluster.")
@click.option("--event-log", type=click.Path(dir_okay=False),
              help="Append every phase change to this JSON-lines file (written every 0.1 s, off the grant path).")
@click.option("--event-log-size", type=click.IntRange(1), default=event_log_file.MAXLEN, show_default=True,
              help="Events kept in memory.")
@click.option("--event-log-max-mb", type=click.FloatRange(0.001), default=event_log_file.MAX_BYTES / _MIB,
              show_default=True,
              help="Rotate --event-log before it grows past this many MiB: FILE becomes FILE.1, and so on.")
@click.option("--event-log-backups", type=click.IntRange(0, 100), default=event_log_file.BACKUPS, show_default=True,
              help="Rotated event-log files kept (FILE.1 .. FILE.N); older ones are deleted.")
@click.option("--max-events-per-s", type=click.FloatRange(0), default=StreamLimits.events_per_s, show_default=True,
              help="Events a session may send per second, sustained (bursts of twice that pass); a session "
              "past it is closed with RESOURCE_EXHAUSTED and its rank trains unscheduled. 0: no limit.")
@click.option("--max-connections", type=click.IntRange(1, 1 << 20), default=StreamLimits.max_connections,
              show_default=True,
              help="Session streams served at once; one more is refused with "
              "RESOURCE_EXHAUSTED (the rank trains unscheduled and retries). `crossover queue` shows the count. "
              "Registered ranks are capped at twice this.")
@click.option("--max-connections-per-user", type=click.IntRange(1, 1 << 20),
              default=StreamLimits.max_connections_per_uid, show_default=True,
              help="Session socket streams one local user (the kernel's uid of the connection) may hold open; one "
              "more from that user is refused with RESOURCE_EXHAUSTED, so no user can take every slot.")
@click.option("--idle-timeout", type=click.FloatRange(1, 86_400), default=StreamLimits.idle_timeout_s,
              show_default=True,
              help="Seconds a session socket connection may stay silent before it is closed "
              "(ranks send a heartbeat every 0.2 s); one that sends no OPEN is closed after 5 s.")
@click.option("--heartbeat-timeout", type=click.FloatRange(0.05, 60), default=LivenessSettings.heartbeat_timeout_s,
              show_default=True,
              help="Seconds without a heartbeat before a rank is suspended: its grant is freed and it leaves "
              "the rotation until it speaks again.")
@click.option("--evict-after", type=click.FloatRange(0.05, 3600), default=LivenessSettings.evict_after_s,
              show_default=True,
              help="Seconds without a heartbeat before a suspended rank is removed (its stream is closed; "
              "the rank re-registers). At least --heartbeat-timeout.")
@click.option("--overdue-factor", type=click.FloatRange(1.5, 1e6), default=LivenessSettings.overdue_factor,
              show_default=True,
              help="A holder past this many times its measured compute time (and past --overdue-after) is "
              "treated as stalled: the next waiting rank gets the device and the event log records `overdue`.")
@click.option("--overdue-after", type=click.FloatRange(0.01, 86_400), default=LivenessSettings.overdue_after_s,
              show_default=True,
              help="Seconds a rank may hold its device before it can be treated as stalled, whatever its "
              "compute time (the floor under --overdue-factor).")
@click.option("--overdue-warmup", type=click.FloatRange(0.01, 86_400), default=LivenessSettings.overdue_warmup_s,
              show_default=True,
              help="The limit for a rank's first compute phase, before it has a measured compute time: a first "
              "step pays for lazy initialisation (allocators, autotuned kernels) and must not read as a stall.")
@click.option("--max-hold", type=click.FloatRange(0.1, 86_400), default=LivenessSettings.max_hold_s, show_default=True,
              help="Seconds any rank may hold its device while another rank waits, whatever its measured "
              "compute time: past it, the holder is treated as stalled (`overdue`) and the next rank is served.")
@click.option("--lease/--no-lease", default=SchedulerSettings.lease, show_default=True,
              help="Let the ranks of a job alone on their device compute without waiting for each grant "
              "(they still report their phases); revoked the moment another rank joins the device. --no-lease "
              "makes every request a round trip.")
@click.option("--adapt/--no-adapt", default=SchedulerSettings.adapt, show_default=True,
              help="Measure, per device, whether grants pay: the jobs there train in alternate windows with and "
              "without grants, and the faster mode is kept for --adapt-window x 20 seconds, then probed again "
              "(and at once when a job comes or goes). Where grants do not pay the device is unscheduled: every "
              "rank on it holds a lease. Where its jobs differ in priority class, only the highest class's progress "
              "counts. `crossover queue` says which mode each device is in and why.")
@click.option("--adapt-window", type=click.FloatRange(0.5, 600), default=PayoffSettings.window_s, show_default=True,
              help="Seconds of one measuring window of --adapt, aligned on the wall clock so that every node "
              "probes in the same windows; its first quarter is left out while a switch takes effect.")
@click.option("--class-rule", "class_rules", multiple=True, metavar="SUBJECT=CLASS[:WEIGHT]",
              help="The priority class (high, normal, low) and weight a rank of this user or group gets, as the "
              "kernel names the session socket's peer: uid:1000=high, gid:50=low, user:alice=high:2, "
              "group:batch=low. Repeat for several; a user's rule wins over its group's. Others get normal; a "
              "rank may lower its class (CROSSOVER_PRIORITY), never raise it. Classes are the crossover "
              "policy's.")
@click.option("--reserve", "reservations", multiple=True, metavar="CLASS=SIZE",
              help="Hold SIZE of each GPU's memory for the jobs of CLASS while one is on it: high=50% or "
              "high=40GiB. Jobs of lower classes there are capped (in their own process, at their allocator) "
              "to what the reservations leave, shared equally, and a job that runs out of its cap is told why in "
              "one line. Repeat for several classes; docs/priorities.md, \"Memory\".")
@click.option("--cpu-device-memory", metavar="SIZE", default="0",
              help="With --cpu-devices: the memory each CPU device stands for (8GiB), so that --reserve caps "
              "ranks of the emulated device on a test bed. 0: none.")
@click.option("--guard-share", type=click.FloatRange(0.0, 0.9), default=ClassSettings.guard_share, show_default=True,
              help="The device time every job of a lower class is guaranteed beside higher ones (0.02: a "
              "fiftieth), so it never stops; a higher job keeps at most 1 minus this where there are no gaps.")
@click.option("--protect", type=click.FloatRange(0.0, 1.0), default=IsolationSettings.target, show_default=True,
              help="Where a device's jobs differ in priority class, hold its highest class at this share of its "
              "speed alone: a closed loop measures that job's iteration time alone (short solo windows) and beside "
              "the lower jobs, and sets how much device time per second they may hold. 0: off, the open-loop class "
              "rules alone.")
@click.option("--session-socket/--no-session-socket", default=Endpoints.session_socket, show_default=True,
              help="Also serve ranks' session streams as plain frames on SOCKET.session, a grant round trip "
              "several times shorter than through gRPC. Ranks fall back to the gRPC stream without it.")
@click.option("--handover/--no-handover", default=SchedulerSettings.handover, show_default=True,
              help="Let ranks on the session socket end their turns on their device: each gets a shared page "
              "whose word its device sets when a turn's work is done, and the next holder's device waits for "
              "it, so no CPU or socket sits between two turns (docs/handover.md). Ranks whose device cannot "
              "(no CUDA stream memory operations) wait for their device on their CPU, as with --no-handover.")
@click.option("--metrics-address", metavar="HOST:PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (a bare PORT: loopback only). "
              "Off by default; docs/metrics.md lists the metrics.")
@click.option("--health-address", metavar="HOST:PORT",
              help="Serve the standard gRPC health service (grpc.health.v1) alone, in plain text and without a "
              "token, for liveness and readiness probes. The sockets and --listen serve it too.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default="INFO", show_default=True)
def main(**flags: Any) -> None:
    """Schedule the compute phases of co-located Horovod jobs on this node's devices.

    Run one per node (GPU machine), then start jobs whose script begins with
    `import crossover.auto`. Watch with `crossover queue`. SIGTERM or Ctrl-C
    stops the daemon cleanly: waiting ranks are released and keep training.

    Ranks (and anyone who may look) use SOCKET; the `crossover` commands that
    steer the daemon (policy NAME, drain, resume, evict, priority and share)
    only SOCKET.admin, the daemon user's alone (see SECURITY.md).

    \b
    Examples:
      crossoverd --cpu-devices 2 --policy exclusive
      crossoverd --listen 0.0.0.0:7070 --token-file /etc/crossover/token
    """
    logging.basicConfig(level=flags["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings, endpoints, limits = _scheduler_settings(flags), _endpoints(flags), _limits(flags)
    metrics = None
    try:
        cores = parse_cpu_devices(flags["cpu_devices"], os.cpu_count() or 1) if flags["cpu_devices"] else None
        inventory = Inventory.detect(cores, _cpu_memory(flags["cpu_device_memory"]))
        core = Scheduler(inventory, settings, event_log=_event_log(flags))
        if flags["metrics_address"]:
            metrics = DaemonMetrics(core, __version__)
            metrics.serve(flags["metrics_address"])
        daemon = Daemon(core, endpoints, limits).start()
        if metrics is not None:
            metrics.watch_connections(daemon.connections)
    except CrossoverError as exc:
        click.echo(f"crossoverd: {exc}", err=True)
        sys.exit(2)
    except (OSError, RuntimeError) as exc:
        if metrics is not None:
            metrics.close()
        click.echo(f"crossoverd: cannot start: {exc}", err=True)
        sys.exit(1)
    _serve(daemon, metrics)


def _scheduler_settings(flags: dict[str, Any]) -> SchedulerSettings:
    """How this node schedules, from the flags; a usage error names the flag at fault."""
    heartbeat_timeout, evict_after = flags["heartbeat_timeout"], flags["evict_after"]
    if evict_after < heartbeat_timeout:
        raise click.BadParameter(f"{evict_after:g} s is shorter than --heartbeat-timeout {heartbeat_timeout:g} s: "
                                 "a rank is removed only after it was suspended", param_hint="'--evict-after'")
    try:
        rules = ClassRules(tuple(parse_rule(r) for r in flags["class_rules"]))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--class-rule") from None
    try:
        memory = MemoryRules.parse(flags["reservations"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--reserve") from None
    return SchedulerSettings(
        policy=flags["policy"], node=flags["node_name"],
        heartbeat_interval_s=min(SchedulerSettings.heartbeat_interval_s, heartbeat_timeout / 4),
        liveness=LivenessSettings(heartbeat_timeout_s=heartbeat_timeout, evict_after_s=evict_after,
                                  overdue_factor=flags["overdue_factor"], overdue_after_s=flags["overdue_after"],
                                  overdue_warmup_s=flags["overdue_warmup"], max_hold_s=flags["max_hold"]),
        lease=flags["lease"], max_sessions=2 * flags["max_connections"], adapt=flags["adapt"],
        payoff=PayoffSettings(window_s=flags["adapt_window"]), class_rules=rules,
        classes=ClassSettings(guard_share=flags["guard_share"], isolation=IsolationSettings(target=flags["protect"])),
        handover=flags["handover"], memory=memory)


def _limits(flags: dict[str, Any]) -> StreamLimits:
    return StreamLimits(events_per_s=flags["max_events_per_s"], max_connections=flags["max_connections"],
                        max_connections_per_uid=flags["max_connections_per_user"],
                        idle_timeout_s=flags["idle_timeout"])


def _event_log(flags: dict[str, Any]) -> EventLog:
    path = flags["event_log"]
    try:
        return EventLog(maxlen=flags["event_log_size"], path=path, max_bytes=int(flags["event_log_max_mb"] * _MIB),
                        backups=flags["event_log_backups"])
    except OSError as exc:
        raise OSError(f"cannot open --event-log {path}: {exc.strerror or exc}") from None


def _endpoints(flags: dict[str, Any]) -> Endpoints:
    """Where the daemon serves and whom it lets in, each flag checked; a usage error names the flag at fault."""
    token, admin_token = _tokens(flags["token"], flags["token_file"], flags["admin_token_file"])
    tls_cert, tls_key = flags["tls_cert"], flags["tls_key"]
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    for flag, address in (("--metrics-address", flags["metrics_address"]),
                          ("--health-address", flags["health_address"])):
        if address:
            try:
                parse_address(address)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=flag) from None
    try:
        tls = (Path(tls_cert).read_bytes(), Path(tls_key).read_bytes()) if tls_cert and tls_key else None
    except OSError as exc:
        raise click.BadParameter(f"cannot read it: {exc.strerror or exc}", param_hint="--tls-cert/--tls-key") from None
    return Endpoints(socket_path=None if flags["no_socket"] else flags["socket_path"], listen=flags["listen"],
                     token=token, tls=tls, session_socket=flags["session_socket"], admin_token=admin_token,
                     socket_group=_group(flags["socket_group"], "--socket-group"),
                     admin_group=_group(flags["admin_group"], "--admin-group"),
                     health_address=flags["health_address"])


def _tokens(token: str | None, token_file: str | None, admin_token_file: str | None) -> tuple[str | None, str | None]:
    """The token ranks send and the admin token, each read and checked."""
    if token and click.get_current_context().get_parameter_source("token") is click.core.ParameterSource.COMMANDLINE:
        _log.warning("--token on the command line is visible to every user in `ps`; prefer --token-file or "
                     "CROSSOVER_TOKEN")
    token = _read_secret(token, token_file, "token")
    admin_token = _read_secret(None, admin_token_file, "admin token")
    if admin_token and admin_token == token:
        raise click.UsageError("the admin token must differ from the token every rank holds")
    return token, admin_token


def _cpu_memory(text: str) -> int:
    if text.strip() in ("", "0"):
        return 0
    try:
        fraction, amount = parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cpu-device-memory") from None
    if fraction:
        raise click.BadParameter(f"{text!r}: give an amount (8GiB), not a share", param_hint="--cpu-device-memory")
    return amount


def _serve(daemon: Daemon, metrics: DaemonMetrics | None) -> None:
    """Serve until SIGTERM or SIGINT, then stop: waiting ranks are released and keep training."""
    def on_signal(signum: int, frame: FrameType | None) -> None:
        _log.info("received %s, shutting down", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if daemon.port:
        _log.info("TCP port %d", daemon.port)
    if daemon.health_port:
        _log.info("health checks on port %d", daemon.health_port)
    daemon.wait()
    if metrics is not None:
        metrics.close()

if __name__ == "__main__":
    main()
