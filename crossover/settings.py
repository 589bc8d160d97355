"""Every plugin setting (`CROSSOVER_*`), each declared once: its variable, field, default, parser and help.

A setting is a field of one of the frozen records below, declared with `setting(...)`
(`crossover.setting_fields`): the variable's name, the typed default, the parser that turns the
variable's text into the value (a bad text is a `SettingError` naming the variable and the text) and the
help. From those declarations come the records' `from_env`, the index `PLUGIN_SETTINGS` (variable ->
`Setting`) and docs/settings.md's table (`python -m scripts.gen_settings_table`). An unset or blank
variable is its default.

`PluginSettings` holds a rank's settings, with `AggregationSettings` (how gradients are combined) and its
`LBBSPSettings` (the weighted rule's batch-size controller) inside. A training process reads them once:
`crossover.auto` at import, or the Horovod hook when a script installs it itself. The rank's session
(`crossover.client.rank`) and the aggregation rules (`crossover.plugins.aggregation`) take that read (the
rules read the environment once themselves where no hook did), so this module sits below both. The CLI
reads `CROSSOVER_DAEMON_USER` through its declaration here too; its own flags (--socket, --address,
--token, --tls-ca) and crossoverd's --socket fall back to their variables by themselves (click's
`envvar`, `crossover.protos.default_socket_path`). The daemon's settings are its flags
(`crossover.daemon.main`).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from crossover.protos import node_socket_path
from crossover.protos.priority import NAMES
from crossover.setting_fields import (
    Setting,
    SettingError,
    batch_caps,
    boolean,
    choice,
    cpu_list,
    declared,
    device_index,
    integer,
    nested,
    number,
    parse_cpu_list,
    read_fields,
    setting,
    text,
    trimmed,
    upper_text,
)

__all__ = ["AggregationSettings", "LBBSPSettings", "PluginSettings", "PLUGIN_SETTINGS", "Setting", "SettingError",
           "declared", "parse_cpu_list", "script_name"]


def script_name() -> str:
    """The running script's name without its suffix: the job's name when `CROSSOVER_JOB_NAME` is unset."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else ""
    return Path(argv0).stem if argv0 else ""


AGGREGATION_RULES = ("average", "sum", "adasum", "weighted", "group_async")
GROUPINGS = ("static", "speed")
GROUP_SCHEDULES = ("fixed", "staged")
EXCHANGE_CODECS = ("fp32", "fp16", "topk")
GROUP_WEIGHTS = ("size", "sum")
ADASUM_IMPLS = ("auto", "native", "plugin")
ADASUM_ALGORITHMS = ("auto", "allgather", "recursive_doubling")
LBBSP_METHODS = ("ema", "numerical")
TRANSPORTS = ("auto", "grpc")
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
        return cls(**read_fields(cls, environ))


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
                                  "group_async: fixed, or staged (the configured period and bound while the "
                                  "parameter service prices 8 exchanges; if they cost a tenth of the period or more "
                                  "at the median, a coarse stage with 4x the period and 2x the bound until the "
                                  "global model's rate of change halves; then the configured ones).")
    exchange_codec: str = setting("CROSSOVER_EXCHANGE_CODEC", "fp32", choice(EXCHANGE_CODECS),
                                  "group_async: how updates travel to the service: fp32, fp16 or topk (largest "
                                  "entries only, the rest kept for later: error feedback).")
    exchange_shared_memory: bool = setting("CROSSOVER_EXCHANGE_SHM", True, boolean,
                                           "group_async: shared memory (/dev/shm) between processes on one node: a "
                                           "leader on the parameter service's node exchanges through it instead of "
                                           "TCP, and a group on one node gets the model through it instead of a "
                                           "broadcast; 0: TCP and broadcasts only.")
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
    param_state: str = setting("CROSSOVER_PARAM_STATE", "", text,
                               "group_async: directory where the parameter service keeps the global model (resumed "
                               "from when it restarts); empty: a temporary one.")
    param_port: int = setting("CROSSOVER_PARAM_PORT", 0, integer(0, 65535),
                              "group_async: the TCP port rank 0's parameter service listens on; 0: any free one "
                              "(fix it where a firewall stands between the nodes).")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> AggregationSettings:
        return cls(**read_fields(cls, environ))


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
    priority: str = setting("CROSSOVER_PRIORITY", "", choice(NAMES),
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
        values = read_fields(cls, environ)
        if script_name and not PLUGIN_SETTINGS["CROSSOVER_JOB_NAME"].is_set(environ):
            values["job_name"] = script_name
        target = values["address"] or f"unix://{values['socket'] or node_socket_path(client=True)}"
        return cls(target=target, **values)


PLUGIN_SETTINGS: dict[str, Setting] = {s.env: s for s in declared(PluginSettings)}
"""Every plugin setting by its variable, in the order docs/settings.md's table lists them."""
