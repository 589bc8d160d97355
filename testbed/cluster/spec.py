"""What an emulated cluster is: its nodes and links (`ClusterSpec`, `Link`), and a built one (`ClusterState`)."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.device_model import DeviceParams

SUBNET = "10.77.0"
HUB_HOST = 254
IFACE = "eth0"  # every node's interface has this name, so one HOROVOD_GLOO_IFACE fits all ranks
STATE_ROOT = Path("/run/crossover/clusters")


class ClusterError(RuntimeError):
    """Building, using or tearing down an emulated cluster failed; the message names the step and the remedy."""


class Unsupported(ClusterError):
    """This machine cannot host an emulated cluster (not root, no `ip`/`tc`, kernel lacks a qdisc)."""


# ---- description ---------------------------------------------------------------------------------


def parse_rate(text: str | float | None) -> float | None:
    """`"200mbit"`, `"1.5gbit"`, `"800kbit"` or a bare number of Mbit/s → Mbit/s; empty/None/`"0"` → unshaped."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text) if text > 0 else None
    s = text.strip().lower()
    if s in ("", "0", "none", "off"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(gbit|mbit|kbit|bit)?(?:/s|ps)?", s)
    if not m:
        raise ClusterError(f"rate {text!r} is not understood: use e.g. 200mbit, 1gbit, 800kbit or a number of Mbit/s")
    scale = {"gbit": 1e3, "mbit": 1.0, "kbit": 1e-3, "bit": 1e-6, None: 1.0}[m.group(2)]
    value = float(m.group(1)) * scale
    return value if value > 0 else None


@dataclass(frozen=True)
class Link:
    """One node's network link, applied to both directions of its veth.

    `delay_ms` is the one-way latency of this node's link in each direction, so
    between nodes i and j a packet takes delay_i + delay_j (RTT twice that).
    Delay and jitter need the kernel's `netem` qdisc; rate needs `tbf`.
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not 0.01 <= self.rate_mbit <= 100_000:
            raise ClusterError(f"link rate {self.rate_mbit} Mbit/s is outside 0.01..100000")
        if not 0 <= self.delay_ms <= 10_000 or not 0 <= self.jitter_ms <= 10_000:
            raise ClusterError(f"delay {self.delay_ms} ms / jitter {self.jitter_ms} ms must be within 0..10000")
        if self.jitter_ms and not self.delay_ms:
            raise ClusterError("jitter needs a delay (netem varies the delay by the jitter)")

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unshaped"]
        if self.delay_ms:
            parts.append(f"+{self.delay_ms:g} ms" + (f" ±{self.jitter_ms:g}" if self.jitter_ms else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class ClusterSpec:
    """What to build. `links` overrides `link` for single nodes (a thinner or farther node)."""

    nodes: int = 2
    link: Link = Link()
    links: Mapping[int, Link] = field(default_factory=dict)
    cores: tuple[int, ...] = ()  # core of node i; default: the usable cores, round-robin
    policy: str = "crossover"
    daemon_args: tuple[str, ...] = ()
    heartbeat_timeout_s: float = 0.8
    # Niceness of daemons and ranks. A GPU is not shared with whatever else runs on the
    # host; an emulated device (a core) is, unless its ranks outrank the other tasks there
    # (negative values need root, and slow everything else on those cores down).
    nice: int = 0
    # Nodes whose daemon schedules this machine's GPUs (found through NVML) instead of a core:
    # one GPU node beside CPU-core nodes emulates one node of a multi-node GPU job (bench.gpu).
    gpu_nodes: tuple[int, ...] = ()
    # A GPU-like device per node (testbed.device_model): ranks submit their compute phases to it
    # instead of running them on the node's core. None: the core is the device.
    device_model: DeviceParams | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ClusterError(f"nodes={self.nodes}: an emulated cluster has 1..200 nodes")
        bad = [i for i in self.links if not 0 <= i < self.nodes]
        if bad:
            raise ClusterError(f"link overrides for nodes {bad} that do not exist (0..{self.nodes - 1})")
        if not -20 <= self.nice <= 19:
            raise ClusterError(f"nice={self.nice} is outside -20..19")
        if any(not 0 <= i < self.nodes for i in self.gpu_nodes):
            raise ClusterError(f"gpu_nodes={list(self.gpu_nodes)} names nodes that do not exist (0..{self.nodes - 1})")
        if self.cores and len(self.cores) != self.nodes:
            raise ClusterError(f"cores={list(self.cores)} must name one core per node ({self.nodes})")

    def link_of(self, i: int) -> Link:
        return self.links.get(i, self.link)

    def core_of(self, i: int) -> int:
        if self.cores:
            return self.cores[i]
        usable = sorted(os.sched_getaffinity(0))
        return usable[i % len(usable)]


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # the daemon's --node-name, as the event log reports it
    netns: str  # also the node's host name for Horovod
    address: str
    core: int
    socket: str
    event_log: str
    log: str
    device_socket: str = ""  # the node's emulated device server (ClusterSpec.device_model), if any

    @property
    def hostname(self) -> str:
        return self.netns


@dataclass(frozen=True)
class ClusterState:
    """A built cluster as `up` records it in `<workdir>/cluster.json`; enough to launch jobs into it."""

    prefix: str
    hub_netns: str
    hub_address: str
    workdir: str
    owner_pid: int
    policy: str
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterState:
        if data.get("version") != 1:
            raise ClusterError(f"cluster state version {data.get('version')!r} is not supported")
        return cls(prefix=data["prefix"], hub_netns=data["hub_netns"], hub_address=data["hub_address"],
                   workdir=data["workdir"], owner_pid=int(data["owner_pid"]), policy=data["policy"],
                   nodes=tuple(Node(**n) for n in data["nodes"]), links=tuple(Link(**x) for x in data["links"]))

    @classmethod
    def load(cls, name_or_dir: str) -> ClusterState:
        """A cluster by `--name` (under /run/crossover/clusters) or by its work dir."""
        path = Path(name_or_dir)
        if not path.is_dir():
            path = STATE_ROOT / name_or_dir
        try:
            return cls.from_json(json.loads((path / "cluster.json").read_text()))
        except FileNotFoundError:
            raise ClusterError(f"no cluster {name_or_dir!r}: neither a work dir nor a name under {STATE_ROOT} "
                               "(start one with `python -m testbed.cluster up --name NAME`)") from None
