"""Every plugin setting (`CROSSOVER_*`) in one place: names, defaults, validation.

Read by a rank's session (`crossover.client.rank`) and by the plugin that opens it
(`crossover.plugins`), so it sits below both. The daemon's settings are `crossoverd`'s
flags (`crossover.daemon.main`). Here the order is: the environment variable, then the
default below. docs/settings.md's table mirrors `PLUGIN_SETTINGS`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from crossover.errors import CrossoverError
from crossover.protos import default_socket_path

__all__ = ["AggregationSettings", "PluginSettings", "PLUGIN_SETTINGS", "SettingError", "parse_cpu_list", "script_name"]

class SettingError(CrossoverError, ValueError):
    """A `CROSSOVER_*` variable or flag has a value we cannot use."""


def script_name() -> str:
    """The running script's name without its suffix: the job's name when `CROSSOVER_JOB_NAME` is unset."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else ""
    return Path(argv0).stem if argv0 else ""


# name -> (default, help); docs/settings.md's table is generated from this.
PLUGIN_SETTINGS: dict[str, tuple[str, str]] = {
    "CROSSOVER_SOCKET": ("(see daemon)", "Unix socket of the node's daemon."),
    "CROSSOVER_ADDRESS": ("", "host:port of a daemon listening on TCP (overrides the socket)."),
    "CROSSOVER_TOKEN": ("", "Shared token for a TCP daemon."),
    "CROSSOVER_TLS_CA": ("", "CA certificate (PEM) to verify a TLS daemon."),
    "CROSSOVER_DAEMON_USER": ("", "User crossoverd runs as: its sockets may belong to it. Sockets of root, of "
                              "this user, or of the owner of a folder only root could hand over (/run/crossover) "
                              "are trusted without it; any other owner is refused."),
    "CROSSOVER_DISABLE": ("0", "1: the import does nothing at all."),
    "CROSSOVER_JOB_NAME": ("script name", "Readable job name shown by `crossover queue`."),
    "CROSSOVER_DEVICE": ("-1", "Device index to ask for; -1 lets the daemon choose (local rank)."),
    "CROSSOVER_GRANT_TIMEOUT": ("30", "Seconds to wait for a grant before computing unscheduled."),
    "CROSSOVER_COOL_OFF": ("10", "Seconds a rank trains unscheduled after a grant timed out before it asks for "
                           "grants again (it never pays the timeout every iteration)."),
    "CROSSOVER_DAEMON_SILENCE": ("1", "Seconds a heartbeat may go unanswered before the rank takes its daemon for "
                                 "frozen (stopped, swapped out) and trains unscheduled until it answers again."),
    "CROSSOVER_CONNECT_TIMEOUT": ("5", "Seconds to wait for a daemon whose socket exists to answer when attaching "
                                         "(a missing socket means no daemon: no wait)."),
    "CROSSOVER_RECONNECT_INTERVAL": ("2", "Seconds between attempts to re-attach to a lost daemon."),
    "CROSSOVER_PIN": ("1", "0: do not pin to the CPU core a CPU device names."),
    "CROSSOVER_HOST_CORES": ("", "CPU devices: cores (`2-5,8`) for the rank's other threads (Horovod's background "
                             "loop, Gloo, gRPC) while its main thread computes on the device's cores, as a GPU "
                             "leaves the host's cores to them; empty: every thread on the device's cores."),
    "CROSSOVER_LEASE": ("1", "Accept a lease when this rank's job is alone on its device: it then computes "
                        "without a grant round trip per iteration until another job's rank joins; 0: always wait "
                        "for grants."),
    "CROSSOVER_PRIORITY": ("", "This job's class on a shared device: low (it fills the gaps of the jobs that "
                           "matter and yields when they ask), normal, or high. A rank may lower the class its "
                           "node gives its user, never raise it: above that is the operator's (crossoverd "
                           "--class-rule, crossover priority); empty: the class the node gives."),
    "CROSSOVER_LOW_DSCP": ("8", "While this job's class is low, the DSCP code point (0..63) of its TCP traffic "
                           "(Horovod's rings among it): 8 is CS1, lower effort, which a node qdisc or switch "
                           "that honours DSCP sends after other jobs' bytes (docs/priorities.md); 0: no mark."),
    "CROSSOVER_REPORT_INTERVAL": ("0.1", "Seconds a rank that does not wait for grants (passthrough, or a lease) "
                                  "may hold its phase reports to send several in one message; each is dated "
                                  "exactly. 0: send each at once."),
    "CROSSOVER_TRANSPORT": ("auto", "How the session stream travels: auto (the daemon's session socket when it "
                            "offers one, for a grant round trip several times shorter; else gRPC) or grpc."),
    "CROSSOVER_HANDOVER": ("1", "End each turn on the device where it can (CUDA stream memory operations on a page "
                           "the daemon shares, over the session socket): the rank releases its device as soon as "
                           "the turn's work is queued and the next rank's work waits on the device, not on two "
                           "CPUs and a socket; 0: wait for the device on the CPU before each release."),
    "CROSSOVER_QUIET_WAIT": ("1", "Wait for the allreduce by polling with short sleeps, leaving the core to a "
                             "co-located job's compute (Horovod's own wait keeps a core busy); only while another rank "
                             "shares the device; 0: Horovod's wait."),
    "CROSSOVER_HOST_STAGING": ("0", "1: on a Horovod without a GPU allreduce (Gloo, no NCCL), while another rank "
                               "shares the GPU, the plugin copies each gradient to host memory itself and queues "
                               "the copies back at the optimizer's synchronize, in one batch, instead of Horovod "
                               "copying them back one by one in the middle of its ring, each waiting for a GPU that "
                               "another job's compute fills (docs/priorities.md); the same results."),
    "CROSSOVER_LOG_LEVEL": ("WARNING", "Log level of the plugin's `crossover` loggers."),
    "CROSSOVER_STATS_FILE": ("", "At exit, write this rank's session stats as JSON here: its first 4096 grant "
                             "waits, their count and a histogram of all; `{rank}` is replaced by the rank."),
    "CROSSOVER_AGGREGATION": ("", "How gradients are combined: average, sum, adasum, weighted (LB-BSP) or "
                              "group_async (synchronous inside groups, asynchronous between them); empty keeps "
                              "the script's own `op`."),
    "CROSSOVER_ADASUM_IMPL": ("auto", "adasum: auto (Horovod's native Adasum where it applies, else the "
                              "plugin's), native (fail where it does not apply) or plugin."),
    "CROSSOVER_ADASUM_ALGORITHM": ("auto", "Plugin Adasum data movement: allgather, recursive_doubling, or auto "
                                   "(allgather up to 8 ranks)."),
    "CROSSOVER_LBBSP_PERIOD": ("10", "weighted: batch sizes may change every this many iterations."),
    "CROSSOVER_LBBSP_METHOD": ("ema", "weighted: speed model, ema (time = fixed cost + per-sample cost, "
                               "fitted) or numerical (fitted time curves)."),
    "CROSSOVER_LBBSP_HYSTERESIS": ("0.05", "weighted: adopt new sizes only if some rank moves by more than this "
                                   "fraction of its batch."),
    "CROSSOVER_LBBSP_MIN_GAIN": ("0.1", "weighted: adopt new sizes only if they are predicted to shorten the "
                                 "iteration by at least this fraction (and by more than the measurements' "
                                 "scatter)."),
    "CROSSOVER_LBBSP_EMA_ALPHA": ("0.3", "weighted: weight of the newest measurement in the speed averages."),
    "CROSSOVER_LBBSP_WARMUP": ("5", "weighted: each rank's first this many measured steps are left out of the "
                               "speed estimates (start-up is not a rank's pace), so the first decision waits for "
                               "steady steps."),
    "CROSSOVER_LBBSP_MAX_BATCH": ("", "weighted: per-rank batch cap (memory), one int or one per rank "
                                  "(`64,64,32`); empty: no cap."),
    "CROSSOVER_GROUPS": ("2", "group_async: a number of groups of consecutive ranks, or one rank list per group "
                         "(`0,1;2,3`)."),
    "CROSSOVER_STALENESS": ("4", "group_async: the SSP bound: a group waits rather than run more than this many "
                            "exchanges ahead of the slowest active group."),
    "CROSSOVER_EXCHANGE_PERIOD": ("0.5", "group_async: seconds between a group's exchanges with the parameter "
                                  "service (wall time, so groups of every pace advance their clocks alike)."),
    "CROSSOVER_GROUPING": ("static", "group_async: static (as CROSSOVER_GROUPS says) or speed (ranks of similar "
                           "measured pace together, revised at epoch boundaries with hysteresis)."),
    "CROSSOVER_GROUP_SCHEDULE": ("fixed", "group_async: fixed, or staged (synchronous profiling steps, a coarse "
                                 "stage with 4x the period and 2x the bound, then the configured ones once the "
                                 "global model's change per epoch halves)."),
    "CROSSOVER_EXCHANGE_CODEC": ("fp32", "group_async: how updates travel to the service: fp32, fp16 or topk "
                                 "(largest entries only, the rest kept for later: error feedback)."),
    "CROSSOVER_EXCHANGE_SHM": ("1", "group_async: a leader on the parameter service's node exchanges through "
                               "shared memory (/dev/shm) instead of TCP; 0: always TCP."),
    "CROSSOVER_GROUP_WEIGHT": ("size", "group_async: how much of a group's update the global model takes: size "
                               "(its share of the ranks; groups in lockstep make synchronous SGD's step) or sum "
                               "(all of it, as Basu et al.; faster, noisier)."),
    "CROSSOVER_GROUP_BALANCE": ("1", "group_async: inside a group, split its batch among its ranks by measured "
                                "pace at each epoch start (LB-BSP inside the group), so a slow rank does not hold "
                                "its group to its pace; 0: equal shares."),
    "CROSSOVER_TOPK_FRACTION": ("0.01", "group_async with topk: the fraction of entries sent per exchange."),
    "CROSSOVER_PROFILE_STEPS": ("5", "group_async with the staged schedule: the synchronous profiling steps "
                                "every rank takes at the start of epoch 0, after which paces are measured "
                                "and the asynchronous stages begin."),
    "CROSSOVER_PARAM_STATE": ("", "group_async: directory where the parameter service keeps the global model "
                              "(resumed from when it restarts); empty: a temporary one."),
}

AGGREGATION_RULES = ("average", "sum", "adasum", "weighted", "group_async")
GROUPINGS = ("static", "speed")
GROUP_SCHEDULES = ("fixed", "staged")
EXCHANGE_CODECS = ("fp32", "fp16", "topk")
GROUP_WEIGHTS = ("size", "sum")
ADASUM_IMPLS = ("auto", "native", "plugin")
ADASUM_ALGORITHMS = ("auto", "allgather", "recursive_doubling")
LBBSP_METHODS = ("ema", "numerical")
TRANSPORTS = ("auto", "grpc")


def _number(name: str, default: Any, lo: Any, hi: Any, convert: Callable[[str], Any], what: str) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = convert(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not {what}") from None
    if not lo <= value <= hi:
        raise SettingError(f"{name}={raw} is outside {lo}..{hi}")
    return value


def _float(name: str, default: float, lo: float, hi: float) -> float:
    return float(_number(name, default, lo, hi, float, "a number"))


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def _choice(name: str, default: str, choices: tuple[str, ...], allow_empty: bool = False) -> str:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        empty = " or empty" if allow_empty else ""
        raise SettingError(f"{name}={raw!r} is not one of {', '.join(choices)}{empty}")
    return raw


def _int(name: str, default: int, lo: int, hi: int) -> int:
    return int(_number(name, default, lo, hi, int, "an integer"))


def parse_cpu_list(raw: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8): the kernel's cpu-list format, sorted, without repeats."""
    cores: set[int] = set()
    for part in raw.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise SettingError(f"{raw!r} is not a cpu list such as 0-3,8") from None
        if first < 0 or last < first:
            raise SettingError(f"{raw!r}: {part!r} is not a range of core numbers")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def _cpu_list(name: str) -> tuple[int, ...]:
    raw = os.environ.get(name, "").strip()
    try:
        return parse_cpu_list(raw)
    except SettingError as exc:
        raise SettingError(f"{name}: {exc}") from None


def _int_list(name: str) -> tuple[int, ...]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return ()
    try:
        values = tuple(int(item) for item in raw.split(","))
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an int or a comma-separated list of ints") from None
    if any(value < 1 for value in values):
        raise SettingError(f"{name}={raw!r}: every cap must be >= 1")
    return values


@dataclass(frozen=True)
class AggregationSettings:
    """How the plugin combines gradients (`CROSSOVER_AGGREGATION` and friends).

    `rule` is empty when the script's own Horovod `op` is kept. `lbbsp_max_batch`
    is empty (no cap), one cap for every rank, or one cap per rank.
    """

    rule: str = ""
    adasum_impl: str = "auto"
    adasum_algorithm: str = "auto"
    lbbsp_period: int = 10
    lbbsp_method: str = "ema"
    lbbsp_hysteresis: float = 0.05
    lbbsp_min_gain: float = 0.1
    lbbsp_ema_alpha: float = 0.3
    lbbsp_warmup: int = 5
    lbbsp_max_batch: tuple[int, ...] = ()
    groups: str = "2"
    staleness: int = 4
    exchange_period_s: float = 0.5
    grouping: str = "static"
    group_schedule: str = "fixed"
    exchange_codec: str = "fp32"
    exchange_shared_memory: bool = True
    topk_fraction: float = 0.01
    group_weight: str = "size"
    group_balance: bool = True
    profile_steps: int = 5
    param_state: str = ""

    @classmethod
    def from_env(cls) -> AggregationSettings:
        return cls(
            rule=_choice("CROSSOVER_AGGREGATION", cls.rule, AGGREGATION_RULES, allow_empty=True),
            adasum_impl=_choice("CROSSOVER_ADASUM_IMPL", cls.adasum_impl, ADASUM_IMPLS),
            adasum_algorithm=_choice("CROSSOVER_ADASUM_ALGORITHM", cls.adasum_algorithm, ADASUM_ALGORITHMS),
            lbbsp_period=_int("CROSSOVER_LBBSP_PERIOD", cls.lbbsp_period, 1, 1_000_000),
            lbbsp_method=_choice("CROSSOVER_LBBSP_METHOD", cls.lbbsp_method, LBBSP_METHODS),
            lbbsp_hysteresis=_float("CROSSOVER_LBBSP_HYSTERESIS", cls.lbbsp_hysteresis, 0.0, 10.0),
            lbbsp_min_gain=_float("CROSSOVER_LBBSP_MIN_GAIN", cls.lbbsp_min_gain, 0.0, 10.0),
            lbbsp_ema_alpha=_float("CROSSOVER_LBBSP_EMA_ALPHA", cls.lbbsp_ema_alpha, 1e-6, 1.0),
            lbbsp_warmup=_int("CROSSOVER_LBBSP_WARMUP", cls.lbbsp_warmup, 0, 1_000_000),
            lbbsp_max_batch=_int_list("CROSSOVER_LBBSP_MAX_BATCH"),
            groups=os.environ.get("CROSSOVER_GROUPS", "").strip() or cls.groups,
            staleness=_int("CROSSOVER_STALENESS", cls.staleness, 0, 1_000_000),
            exchange_period_s=_float("CROSSOVER_EXCHANGE_PERIOD", cls.exchange_period_s, 0.0, 86_400.0),
            grouping=_choice("CROSSOVER_GROUPING", cls.grouping, GROUPINGS),
            group_schedule=_choice("CROSSOVER_GROUP_SCHEDULE", cls.group_schedule, GROUP_SCHEDULES),
            exchange_codec=_choice("CROSSOVER_EXCHANGE_CODEC", cls.exchange_codec, EXCHANGE_CODECS),
            exchange_shared_memory=_bool("CROSSOVER_EXCHANGE_SHM", cls.exchange_shared_memory),
            topk_fraction=_float("CROSSOVER_TOPK_FRACTION", cls.topk_fraction, 1e-6, 1.0),
            group_weight=_choice("CROSSOVER_GROUP_WEIGHT", cls.group_weight, GROUP_WEIGHTS),
            group_balance=_bool("CROSSOVER_GROUP_BALANCE", cls.group_balance),
            profile_steps=_int("CROSSOVER_PROFILE_STEPS", cls.profile_steps, 0, 1_000_000),
            param_state=os.environ.get("CROSSOVER_PARAM_STATE", cls.param_state),
        )


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings, read from `CROSSOVER_*` variables once at import (`from_env`).
    Built directly, each field not given has the default its variable has."""

    target: str
    token: str = ""
    tls_ca: str = ""
    disabled: bool = False
    job_name: str = "job"
    device: int = -1
    grant_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    reconnect_interval_s: float = 2.0
    pin: bool = True
    host_cores: tuple[int, ...] = ()
    log_level: str = "WARNING"
    quiet_wait: bool = True
    host_staging: bool = False
    cool_off_s: float = 10.0
    daemon_silence_s: float = 1.0
    lease: bool = True
    priority: str = ""  # low, normal, high; "": what the node gives
    low_dscp: int = 8  # DSCP of the job's TCP traffic while its class is low; 0: unmarked
    report_interval_s: float = 0.1
    transport: str = "auto"
    handover: bool = True
    stats_file: str = ""
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)

    @classmethod
    def from_env(cls, script_name: str = "") -> PluginSettings:
        address = os.environ.get("CROSSOVER_ADDRESS", "")
        target = address if address else f"unix://{default_socket_path(client=True)}"
        device_raw = os.environ.get("CROSSOVER_DEVICE", "-1")
        try:
            device = int(device_raw)
        except ValueError:
            raise SettingError(f"CROSSOVER_DEVICE={device_raw!r} is not an integer") from None
        if device < -1:
            raise SettingError(f"CROSSOVER_DEVICE={device} must be -1 or a device index")
        return cls(
            target=target,
            token=os.environ.get("CROSSOVER_TOKEN", cls.token),
            tls_ca=os.environ.get("CROSSOVER_TLS_CA", cls.tls_ca),
            disabled=_bool("CROSSOVER_DISABLE", cls.disabled),
            job_name=os.environ.get("CROSSOVER_JOB_NAME", "") or script_name or cls.job_name,
            device=device,
            grant_timeout_s=_float("CROSSOVER_GRANT_TIMEOUT", cls.grant_timeout_s, 0.001, 3600.0),
            connect_timeout_s=_float("CROSSOVER_CONNECT_TIMEOUT", cls.connect_timeout_s, 0.01, 60.0),
            reconnect_interval_s=_float("CROSSOVER_RECONNECT_INTERVAL", cls.reconnect_interval_s, 0.05, 600.0),
            pin=_bool("CROSSOVER_PIN", cls.pin),
            host_cores=_cpu_list("CROSSOVER_HOST_CORES"),
            quiet_wait=_bool("CROSSOVER_QUIET_WAIT", cls.quiet_wait),
            host_staging=_bool("CROSSOVER_HOST_STAGING", cls.host_staging),
            cool_off_s=_float("CROSSOVER_COOL_OFF", cls.cool_off_s, 0.0, 86_400.0),
            daemon_silence_s=_float("CROSSOVER_DAEMON_SILENCE", cls.daemon_silence_s, 0.05, 3600.0),
            lease=_bool("CROSSOVER_LEASE", cls.lease),
            priority=_choice("CROSSOVER_PRIORITY", cls.priority, ("low", "normal", "high")),
            low_dscp=_int("CROSSOVER_LOW_DSCP", cls.low_dscp, 0, 63),
            report_interval_s=_float("CROSSOVER_REPORT_INTERVAL", cls.report_interval_s, 0.0, 1.0),
            transport=_choice("CROSSOVER_TRANSPORT", cls.transport, TRANSPORTS),
            handover=_bool("CROSSOVER_HANDOVER", cls.handover),
            log_level=os.environ.get("CROSSOVER_LOG_LEVEL", cls.log_level).upper(),
            stats_file=os.environ.get("CROSSOVER_STATS_FILE", cls.stats_file),
            aggregation=AggregationSettings.from_env(),
        )
