"""Every plugin setting (`CROSSOVER_*`), each declared once: its variable, field, default, parser and help.

A setting is a field of one of the frozen records below, declared with `setting(...)`: the variable's
name, the typed default, the parser that turns the variable's text into the value (a bad text is a
`SettingError` naming the variable and the text) and the help. From those declarations come the records'
`from_env`, the index `PLUGIN_SETTINGS` (variable -> `Setting`) and docs/settings.md's table
(`python -m scripts.gen_settings_table`). An unset or blank variable is its default.

`PluginSettings` holds a rank's settings, with `AggregationSettings` (how gradients are combined) and its
`LBBSPSettings` (the weighted rule's batch-size controller) inside. A training process reads them once:
`crossover.auto` at import, or the Horovod hook when a script installs it itself; the rank's session
(`crossover.client.rank`) and the aggregation rules (`crossover.plugins.aggregation`) take that read, so
this module sits below both. The CLI reads `CROSSOVER_DAEMON_USER` through its declaration here too. The
CLI's own flags (--socket, --address, --token, --tls-ca) and crossoverd's --socket fall back to the same
variables by themselves (click's `envvar`, `crossover.protos.default_socket_path`); the daemon's settings
are its flags (`crossover.daemon.main`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from crossover.errors import CrossoverError
from crossover.protos import node_socket_path

__all__ = ["AggregationSettings", "LBBSPSettings", "PluginSettings", "PLUGIN_SETTINGS", "Setting", "SettingError",
           "declared", "parse_cpu_list", "script_name"]


class SettingError(CrossoverError, ValueError):
    """A `CROSSOVER_*` variable or flag has a value we cannot use."""


def script_name() -> str:
    """The running script's name without its suffix: the job's name when `CROSSOVER_JOB_NAME` is unset."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else ""
    return Path(argv0).stem if argv0 else ""


Parse = Callable[[str, str], Any]
"""(variable, its text) -> the value; a `SettingError` naming the variable when the text is no such value."""


@dataclass(frozen=True)
class Setting:
    """One `CROSSOVER_*` variable: its name, its default, how its text is read, and what it means.

    `shown` is the docs table's default where the field's default is not what a rank gets (one worked
    out at start: the daemon's socket, the script's name)."""

    env: str
    default: Any
    parse: Parse
    meaning: str
    shown: Optional[str] = None

    def is_set(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        return bool((os.environ if environ is None else environ).get(self.env, "").strip())

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The variable's value in `environ` (the process's environment), or the default when it is unset."""
        raw = (os.environ if environ is None else environ).get(self.env, "")
        return self.parse(self.env, raw) if raw.strip() else self.default

    def default_text(self) -> str:
        """The default as a user would write it: docs/settings.md's column."""
        if self.shown is not None:
            return self.shown
        value = self.default
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return str(value)


def setting(env: str, default: Any, parse: Parse, meaning: str, shown: Optional[str] = None) -> Any:
    """A record's field that is the variable `env`: the field's default is the setting's."""
    return field(default=default, metadata={"setting": Setting(env, default, parse, meaning, shown)})


def nested(record: type) -> Any:
    """A record's field that is another record of settings, read with it."""
    return field(default_factory=record, metadata={"record": record})


def declared(record: type) -> list[Setting]:
    """Every setting a record declares, its nested records' included, in field order."""
    found: list[Setting] = []
    for f in dataclasses.fields(record):
        if "setting" in f.metadata:
            found.append(f.metadata["setting"])
        elif "record" in f.metadata:
            found += declared(f.metadata["record"])
    return found


def _values(record: type, environ: Optional[Mapping[str, str]]) -> dict[str, Any]:
    """Each declared field's value from the environment, nested records built the same way."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if "setting" in f.metadata:
            values[f.name] = f.metadata["setting"].read(environ)
        elif "record" in f.metadata:
            values[f.name] = f.metadata["record"](**_values(f.metadata["record"], environ))
    return values


# ---- parsers: (variable, text) -> value -------------------------------------------------------------


def text(_name: str, raw: str) -> str:
    """Any text, as given."""
    return raw


def trimmed(_name: str, raw: str) -> str:
    """Any text, without the blanks around it."""
    return raw.strip()


def upper_text(_name: str, raw: str) -> str:
    return raw.upper()


def boolean(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{name}={word!r} is not a boolean (use 1 or 0)")


def _number(name: str, raw: str, lo: Any, hi: Any, convert: Callable[[str], Any], what: str) -> Any:
    raw = raw.strip()
    try:
        value = convert(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not {what}") from None
    if not lo <= value <= hi:
        raise SettingError(f"{name}={raw} is outside {lo}..{hi}")
    return value


def integer(lo: int, hi: int) -> Parse:
    """An int within lo..hi."""
    return lambda name, raw: int(_number(name, raw, lo, hi, int, "an integer"))


def number(lo: float, hi: float) -> Parse:
    """A float within lo..hi."""
    return lambda name, raw: float(_number(name, raw, lo, hi, float, "a number"))


def choice(options: tuple[str, ...], allow_empty: bool = False) -> Parse:
    """One of `options`, in any case (`allow_empty`: the default, empty, is none of them)."""
    def parse(name: str, raw: str) -> str:
        word = raw.strip().lower()
        if word not in options:
            empty = " or empty" if allow_empty else ""
            raise SettingError(f"{name}={word!r} is not one of {', '.join(options)}{empty}")
        return word
    return parse


def device_index(name: str, raw: str) -> int:
    try:
        index = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an integer") from None
    if index < -1:
        raise SettingError(f"{name}={index} must be -1 or a device index")
    return index


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


def cpu_list(name: str, raw: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(raw.strip())
    except SettingError as exc:
        raise SettingError(f"{name}: {exc}") from None


def batch_caps(name: str, raw: str) -> tuple[int, ...]:
    """One int, or one per rank (`64,64,32`), each at least 1."""
    raw = raw.strip()
    try:
        values = tuple(int(item) for item in raw.split(","))
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an int or a comma-separated list of ints") from None
    if any(value < 1 for value in values):
        raise SettingError(f"{name}={raw!r}: every cap must be >= 1")
    return values


# ---- the settings ------------------------------------------------------------------------------------

AGGREGATION_RULES = ("average", "sum", "adasum", "weighted", "group_async")
GROUPINGS = ("static", "speed")
GROUP_SCHEDULES = ("fixed", "staged")
EXCHANGE_CODECS = ("fp32", "fp16", "topk")
GROUP_WEIGHTS = ("size", "sum")
ADASUM_IMPLS = ("auto", "native", "plugin")
ADASUM_ALGORITHMS = ("auto", "allgather", "recursive_doubling")
LBBSP_METHODS = ("ema", "numerical")
TRANSPORTS = ("auto", "grpc")
PRIORITIES = ("low", "normal", "high")
_MANY = 1_000_000


@dataclass(frozen=True)
class LBBSPSettings:
    """The weighted rule's batch-size controller: the `CROSSOVER_LBBSP_*` variables, and what
    `aggregation.batch_sampler` takes to tune one sampler in code. `max_batch` is empty (no cap), one
    cap for every rank, or one cap per rank."""

    period: int = setting("CROSSOVER_LBBSP_PERIOD", 10, integer(1, _MANY),
                          "weighted: batch sizes may change every this many iterations.")
    method: str = setting("CROSSOVER_LBBSP_METHOD", "ema", choice(LBBSP_METHODS),
                          "weighted: speed model, ema (time = fixed cost + per-sample cost, fitted) or numerical "
                          "(fitted time curves).")
    hysteresis: float = setting("CROSSOVER_LBBSP_HYSTERESIS", 0.05, number(0.0, 10.0),
                                "weighted: adopt new sizes only if some rank moves by more than this fraction of "
                                "its batch.")
    min_gain: float = setting("CROSSOVER_LBBSP_MIN_GAIN", 0.1, number(0.0, 10.0),
                              "weighted: adopt new sizes only if they are predicted to shorten the iteration by at "
                              "least this fraction (and by more than the measurements' scatter).")
    ema_alpha: float = setting("CROSSOVER_LBBSP_EMA_ALPHA", 0.3, number(1e-6, 1.0),
                               "weighted: weight of the newest measurement in the speed averages.")
    warmup: int = setting("CROSSOVER_LBBSP_WARMUP", 5, integer(0, _MANY),
                          "weighted: each rank's first this many measured steps are left out of the speed "
                          "estimates (start-up is not a rank's pace), so the first decision waits for steady steps.")
    max_batch: tuple[int, ...] = setting("CROSSOVER_LBBSP_MAX_BATCH", (), batch_caps,
                                         "weighted: per-rank batch cap (memory), one int or one per rank "
                                         "(`64,64,32`); empty: no cap.")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> LBBSPSettings:
        return cls(**_values(cls, environ))


@dataclass(frozen=True)
class AggregationSettings:
    """How the plugin combines gradients (`CROSSOVER_AGGREGATION` and friends).

    `rule` is empty when the script's own Horovod `op` is kept."""

    rule: str = setting("CROSSOVER_AGGREGATION", "", choice(AGGREGATION_RULES, allow_empty=True),
                        "How gradients are combined: average, sum, adasum, weighted (LB-BSP) or group_async "
                        "(synchronous inside groups, asynchronous between them); empty keeps the script's own `op`.")
    adasum_impl: str = setting("CROSSOVER_ADASUM_IMPL", "auto", choice(ADASUM_IMPLS),
                               "adasum: auto (Horovod's native Adasum where it applies, else the plugin's), native "
                               "(fail where it does not apply) or plugin.")
    adasum_algorithm: str = setting("CROSSOVER_ADASUM_ALGORITHM", "auto", choice(ADASUM_ALGORITHMS),
                                    "Plugin Adasum data movement: allgather, recursive_doubling, or auto (allgather "
                                    "up to 8 ranks).")
    lbbsp: LBBSPSettings = nested(LBBSPSettings)
    groups: str = setting("CROSSOVER_GROUPS", "2", trimmed,
                          "group_async: a number of groups of consecutive ranks, or one rank list per group "
                          "(`0,1;2,3`).")
    staleness: int = setting("CROSSOVER_STALENESS", 4, integer(0, _MANY),
                             "group_async: the SSP bound: a group waits rather than run more than this many "
                             "exchanges ahead of the slowest active group.")
    exchange_period_s: float = setting("CROSSOVER_EXCHANGE_PERIOD", 0.5, number(0.0, 86_400.0),
                                       "group_async: seconds between a group's exchanges with the parameter service "
                                       "(wall time, so groups of every pace advance their clocks alike).")
    grouping: str = setting("CROSSOVER_GROUPING", "static", choice(GROUPINGS),
                            "group_async: static (as CROSSOVER_GROUPS says) or speed (ranks of similar measured pace "
                            "together, revised at epoch boundaries with hysteresis).")
    group_schedule: str = setting("CROSSOVER_GROUP_SCHEDULE", "fixed", choice(GROUP_SCHEDULES),
                                  "group_async: fixed, or staged (synchronous profiling steps, a coarse stage with 4x "
                                  "the period and 2x the bound, then the configured ones once the global model's "
                                  "change per epoch halves).")
    exchange_codec: str = setting("CROSSOVER_EXCHANGE_CODEC", "fp32", choice(EXCHANGE_CODECS),
                                  "group_async: how updates travel to the service: fp32, fp16 or topk (largest "
                                  "entries only, the rest kept for later: error feedback).")
    exchange_shared_memory: bool = setting("CROSSOVER_EXCHANGE_SHM", True, boolean,
                                           "group_async: a leader on the parameter service's node exchanges through "
                                           "shared memory (/dev/shm) instead of TCP; 0: always TCP.")
    group_weight: str = setting("CROSSOVER_GROUP_WEIGHT", "size", choice(GROUP_WEIGHTS),
                                "group_async: how much of a group's update the global model takes: size (its share "
                                "of the ranks; groups in lockstep make synchronous SGD's step) or sum (all of it, as "
                                "Basu et al.; faster, noisier).")
    group_balance: bool = setting("CROSSOVER_GROUP_BALANCE", True, boolean,
                                  "group_async: inside a group, split its batch among its ranks by measured pace at "
                                  "each epoch start (LB-BSP inside the group), so a slow rank does not hold its group "
                                  "to its pace; 0: equal shares.")
    topk_fraction: float = setting("CROSSOVER_TOPK_FRACTION", 0.01, number(1e-6, 1.0),
                                   "group_async with topk: the fraction of entries sent per exchange.")
    profile_steps: int = setting("CROSSOVER_PROFILE_STEPS", 5, integer(0, _MANY),
                                 "group_async with the staged schedule: the synchronous profiling steps every rank "
                                 "takes at the start of epoch 0, after which paces are measured and the asynchronous "
                                 "stages begin.")
    param_state: str = setting("CROSSOVER_PARAM_STATE", "", text,
                               "group_async: directory where the parameter service keeps the global model (resumed "
                               "from when it restarts); empty: a temporary one.")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> AggregationSettings:
        return cls(**_values(cls, environ))


@dataclass(frozen=True)
class PluginSettings:
    """A rank's settings. Built directly, each field not given has its variable's default.

    `target` is where the daemon answers, which `from_env` works out: `CROSSOVER_ADDRESS` when set, else
    the Unix socket `CROSSOVER_SOCKET`, else the node's usual socket (`crossover.protos.node_socket_path`)."""

    target: str
    socket: str = setting("CROSSOVER_SOCKET", "", text, "Unix socket of the node's daemon.", shown="(see daemon)")
    address: str = setting("CROSSOVER_ADDRESS", "", text,
                           "host:port of a daemon listening on TCP (overrides the socket).")
    token: str = setting("CROSSOVER_TOKEN", "", text, "Shared token for a TCP daemon.")
    tls_ca: str = setting("CROSSOVER_TLS_CA", "", text, "CA certificate (PEM) to verify a TLS daemon.")
    daemon_user: str = setting("CROSSOVER_DAEMON_USER", "", text,
                               "User crossoverd runs as: its sockets may belong to it. Sockets of root, of this "
                               "user, or of the owner of a folder only root could hand over (/run/crossover) are "
                               "trusted without it; any other owner is refused.")
    disabled: bool = setting("CROSSOVER_DISABLE", False, boolean, "1: the import does nothing at all.")
    job_name: str = setting("CROSSOVER_JOB_NAME", "job", text, "Readable job name shown by `crossover queue`.",
                            shown="script name")
    device: int = setting("CROSSOVER_DEVICE", -1, device_index,
                          "Device index to ask for; -1 lets the daemon choose (local rank).")
    grant_timeout_s: float = setting("CROSSOVER_GRANT_TIMEOUT", 30.0, number(0.001, 3600.0),
                                     "Seconds to wait for a grant before computing unscheduled.")
    cool_off_s: float = setting("CROSSOVER_COOL_OFF", 10.0, number(0.0, 86_400.0),
                                "Seconds a rank trains unscheduled after a grant timed out before it asks for grants "
                                "again (it never pays the timeout every iteration).")
    daemon_silence_s: float = setting("CROSSOVER_DAEMON_SILENCE", 1.0, number(0.05, 3600.0),
                                      "Seconds a heartbeat may go unanswered before the rank takes its daemon for "
                                      "frozen (stopped, swapped out) and trains unscheduled until it answers again.")
    connect_timeout_s: float = setting("CROSSOVER_CONNECT_TIMEOUT", 5.0, number(0.01, 60.0),
                                       "Seconds to wait for a daemon whose socket exists to answer when attaching "
                                       "(a missing socket means no daemon: no wait).")
    reconnect_interval_s: float = setting("CROSSOVER_RECONNECT_INTERVAL", 2.0, number(0.05, 600.0),
                                          "Seconds between attempts to re-attach to a lost daemon.")
    pin: bool = setting("CROSSOVER_PIN", True, boolean, "0: do not pin to the CPU core a CPU device names.")
    host_cores: tuple[int, ...] = setting("CROSSOVER_HOST_CORES", (), cpu_list,
                                          "CPU devices: cores (`2-5,8`) for the rank's other threads (Horovod's "
                                          "background loop, Gloo, gRPC) while its main thread computes on the "
                                          "device's cores, as a GPU leaves the host's cores to them; empty: every "
                                          "thread on the device's cores.")
    lease: bool = setting("CROSSOVER_LEASE", True, boolean,
                          "Accept a lease when this rank's job is alone on its device: it then computes without a "
                          "grant round trip per iteration until another job's rank joins; 0: always wait for grants.")
    priority: str = setting("CROSSOVER_PRIORITY", "", choice(PRIORITIES),
                            "This job's class on a shared device: low (it fills the gaps of the jobs that matter and "
                            "yields when they ask), normal, or high. A rank may lower the class its node gives its "
                            "user, never raise it: above that is the operator's (crossoverd --class-rule, crossover "
                            "priority); empty: the class the node gives.")
    low_dscp: int = setting("CROSSOVER_LOW_DSCP", 8, integer(0, 63),
                            "While this job's class is low, the DSCP code point (0..63) of its TCP traffic (Horovod's "
                            "rings among it): 8 is CS1, lower effort, which a node qdisc or switch that honours DSCP "
                            "sends after other jobs' bytes (docs/priorities.md); 0: no mark.")
    report_interval_s: float = setting("CROSSOVER_REPORT_INTERVAL", 0.1, number(0.0, 1.0),
                                       "Seconds a rank that does not wait for grants (passthrough, or a lease) may "
                                       "hold its phase reports to send several in one message; each is dated "
                                       "exactly. 0: send each at once.")
    transport: str = setting("CROSSOVER_TRANSPORT", "auto", choice(TRANSPORTS),
                             "How the session stream travels: auto (the daemon's session socket when it offers one, "
                             "for a grant round trip several times shorter; else gRPC) or grpc.")
    handover: bool = setting("CROSSOVER_HANDOVER", True, boolean,
                             "End each turn on the device where it can (CUDA stream memory operations on a page the "
                             "daemon shares, over the session socket): the rank releases its device as soon as the "
                             "turn's work is queued and the next rank's work waits on the device, not on two CPUs and "
                             "a socket; 0: wait for the device on the CPU before each release.")
    quiet_wait: bool = setting("CROSSOVER_QUIET_WAIT", True, boolean,
                               "Wait for the allreduce by polling with short sleeps, leaving the core to a co-located "
                               "job's compute (Horovod's own wait keeps a core busy); only while another rank shares "
                               "the device; 0: Horovod's wait.")
    host_staging: bool = setting("CROSSOVER_HOST_STAGING", False, boolean,
                                 "1: on a Horovod without a GPU allreduce (Gloo, no NCCL), while another rank shares "
                                 "the GPU, the plugin copies each gradient to host memory itself and queues the "
                                 "copies back at the optimizer's synchronize, in one batch, instead of Horovod "
                                 "copying them back one by one in the middle of its ring, each waiting for a GPU that "
                                 "another job's compute fills (docs/priorities.md); the same results.")
    log_level: str = setting("CROSSOVER_LOG_LEVEL", "WARNING", upper_text,
                             "Log level of the plugin's `crossover` loggers.")
    stats_file: str = setting("CROSSOVER_STATS_FILE", "", text,
                              "At exit, write this rank's session stats as JSON here: its first 4096 grant waits, "
                              "their count and a histogram of all; `{rank}` is replaced by the rank.")
    aggregation: AggregationSettings = nested(AggregationSettings)

    @classmethod
    def from_env(cls, script_name: str = "", environ: Optional[Mapping[str, str]] = None) -> PluginSettings:
        """The settings the environment gives; the job is named after `script_name` when
        `CROSSOVER_JOB_NAME` does not name it."""
        values = _values(cls, environ)
        if script_name and not PLUGIN_SETTINGS["CROSSOVER_JOB_NAME"].is_set(environ):
            values["job_name"] = script_name
        target = values["address"] or f"unix://{values['socket'] or node_socket_path(client=True)}"
        return cls(target=target, **values)


PLUGIN_SETTINGS: dict[str, Setting] = {s.env: s for s in declared(PluginSettings)}
"""Every plugin setting by its variable, in the order docs/settings.md's table lists them."""
