"""An emulated cluster on one machine: network namespaces, shaped links, one crossoverd per node.

Layout of a cluster whose namespaces share the prefix `xo<pid>c<k>` (unique per
owning process and cluster, so parallel runs and tests never collide)::

    hub namespace  `<prefix>h`: bridge `br0` 10.77.0.254/24, veth `n<i>` per node
      |                         (the hub end of node i's link, shaped for downloads)
    node namespace `<prefix>n<i>`: `eth0` 10.77.0.<i+1>/24 (shaped for uploads),
                                   crossoverd --cpu-devices <core i> --node-name node<i>

Nothing is created in the root namespace and no route leaves the bridge: the
addresses exist only inside namespaces this module made. Each node's link is a
tc `tbf` on both ends of its veth (rate), under a `netem` (delay, jitter) where
the kernel has one.

Jobs are launched with Horovod's own Gloo runner (`horovod.runner.gloo_run.
launch_gloo`: host assignment, rendezvous server, per-slot environment, output
forwarding, terminate-all-on-failure) running inside the hub namespace; only
the per-slot `exec_command` is ours: instead of ssh it wraps each rank's
command in `ip netns exec <node namespace>` and points the plugin at that
node's daemon.

Teardown (`down`) kills every process inside the cluster's namespaces (found
with `ip netns pids`, so ranks that escaped their launcher are found too) and
deletes the namespaces, which destroys the veths and the bridge. It runs on
leaving the `with` block (exception or not), on SIGTERM/SIGHUP (turned into
`SystemExit`), on Ctrl-C (`KeyboardInterrupt`) and at interpreter exit.
`down --stale` removes what a SIGKILLed owner left behind.

    python -m tools.cluster up --nodes 2 --rate 200mbit --policy crossover --name demo
    python -m tools.cluster run --cluster demo -- python train.py      # another terminal
    python -m tools.cluster run --nodes 2 --rate 100mbit -- python train.py  # ephemeral
    python -m tools.cluster shape --cluster demo --node 1 --rate 50mbit
    python -m tools.cluster down demo | down --stale
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Callable

# This module forks+execs daemons and ranks while its process may hold gRPC channels
# (readiness checks, a benchmark's SetPolicy calls). gRPC's own fork handlers can then
# deadlock inside fork() (grpc/grpc#37259).
# Every child execs at once, so the handlers buy nothing: turn them off before gRPC starts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__ = [
    "Link",
    "ClusterSpec",
    "Node",
    "ClusterState",
    "Cluster",
    "ClusterJob",
    "ClusterError",
    "Unsupported",
    "preflight",
    "netem_available",
    "parse_rate",
    "launch_job",
    "measure_throughput",
    "cleanup_stale",
    "main",
]

_log = logging.getLogger(__name__)

SUBNET = "10.77.0"
HUB_HOST = 254
IFACE = "eth0"  # every node's interface has this name, so one HOROVOD_GLOO_IFACE fits all ranks
STATE_ROOT = Path("/run/crossover/clusters")
CHECKOUT = Path(__file__).resolve().parents[2]  # `tools` runs from a checkout; the hub's launcher imports it
_ETC_NETNS = Path("/etc/netns")  # per-namespace /etc overrides, see ip-netns(8)
_NS_RE = re.compile(r"^xo(\d+)c(\d+)(h|n\d+)$")
_PER_NODE_ENV = ("CROSSOVER_SOCKET", "CROSSOVER_ADDRESS", "CROSSOVER_NODE")


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

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ClusterError(f"nodes={self.nodes}: an emulated cluster has 1..200 nodes")
        bad = [i for i in self.links if not 0 <= i < self.nodes]
        if bad:
            raise ClusterError(f"link overrides for nodes {bad} that do not exist (0..{self.nodes - 1})")
        if not -20 <= self.nice <= 19:
            raise ClusterError(f"nice={self.nice} is outside -20..19")
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
                               "(start one with `python -m tools.cluster up --name NAME`)") from None


# ---- preflight ---------------------------------------------------------------------------------------


def preflight() -> list[str]:
    """Why this machine cannot host an emulated cluster; empty when it can."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append("not root (network namespaces, veth and tc need CAP_NET_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            reasons.append(f"`{tool}` is not installed (Debian: apt-get install iproute2)")
    if not sys.platform.startswith("linux"):
        reasons.append("network namespaces are Linux only")
    return reasons


_netem_cache: dict[str, bool] = {}


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (link delay and jitter); probed once in a scratch namespace."""
    if "v" not in _netem_cache:
        ns = f"xo{os.getpid()}c999h"
        try:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            res = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
                       check=False)
            _netem_cache["v"] = res.returncode == 0
        except ClusterError:
            _netem_cache["v"] = False
        finally:
            _run(["ip", "netns", "delete", ns], check=False)
    return _netem_cache["v"]


# ---- process helpers -----------------------------------------------------------------------------


def _run(argv: Sequence[str], check: bool = True, input: str | None = None,
         timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=timeout)
    except FileNotFoundError:
        raise Unsupported(f"`{argv[0]}` is not installed (Debian: apt-get install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{shlex.join(argv)}` did not finish in {timeout:.0f}s") from None
    if check and res.returncode != 0:
        msg = (res.stderr or res.stdout).strip()
        if "Operation not permitted" in msg:
            raise Unsupported(f"`{shlex.join(argv)}`: {msg} (run as root)")
        raise ClusterError(f"`{shlex.join(argv)}` failed: {msg}")
    return res


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, *argv], check=check)


def _netns_list() -> set[str]:
    res = _ip("netns", "list", check=False)
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


def _ns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _python_m(module: str, *args: str) -> list[str]:
    """`python -m module args` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the thread that started it dies (covers a SIGKILLed owner)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _popen(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    # PDEATHSIG fires when the *thread* that forked dies, so only tie children to the main thread.
    preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
    with open(log, "ab") as out:
        return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, start_new_session=True,
                                preexec_fn=preexec)


def _kill_ns_processes(ns: str, grace_s: float) -> list[int]:
    """SIGTERM everything inside `ns`, SIGKILL what is left after `grace_s`; returns pids that survived."""
    pids = _ns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = _ns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 3.0
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = _ns_pids(ns)
    return pids


# ---- shaping ---------------------------------------------------------------------------------------


def _tc_commands(dev: str, link: Link) -> list[list[str]]:
    """tc invocations (after clearing the root qdisc) that give `dev` the link's rate and delay."""
    cmds: list[list[str]] = []
    parent = ["root", "handle", "1:"]
    if link.needs_netem:
        netem = ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{link.delay_ms}ms"]
        if link.jitter_ms:
            netem += [f"{link.jitter_ms}ms", "distribution", "normal"]
        netem += ["limit", "100000"]
        cmds.append(netem)
        parent = ["parent", "1:1", "handle", "10:"]
    if link.rate_mbit:
        rate_bps = link.rate_mbit * 1e6
        # Burst: at least one 64 KiB GSO packet plus headers. A smaller bucket makes tbf
        # segment every GSO packet in software, which on a 2-core VM burnt ~0.5 core of
        # softirq at 320 Mbit/s (measured) and slowed the "devices" we emulate; with
        # 96 KiB it is ~0.01 core. Queue: 100 ms, so TCP is not starved by drops.
        burst = max(96 * 1024, int(rate_bps / 8 * 0.001))
        cmds.append(["tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{rate_bps:.0f}bit",
                     "burst", str(burst), "latency", "100ms"])
    return cmds


def _apply_link(ns: str, dev: str, link: Link) -> None:
    _in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    for cmd in _tc_commands(dev, link):
        res = _in_ns(ns, *cmd, check=False)
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            if "netem" in cmd and "unknown" in msg.lower():
                raise Unsupported("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay and jitter "
                                  "cannot be emulated here; rate shaping (tbf) works: drop --delay/--jitter")
            raise ClusterError(f"tc on {ns}/{dev} failed: `{shlex.join(cmd)}`: {msg}")


# ---- jobs ---------------------------------------------------------------------------------------------


@dataclass
class ClusterJob:
    """One Horovod job across the cluster: its launcher process (Horovod's Gloo runner in the hub namespace)."""

    name: str
    proc: subprocess.Popen
    log: Path
    np: int
    started: float = field(default_factory=time.monotonic)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The launcher's exit code; on timeout the job is stopped and `ClusterError` names its log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ClusterError(f"job {self.name} did not finish in {timeout:.0f}s (stopped); "
                               f"log {self.log}:\n{self.output()[-3000:]}") from None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the launcher (Horovod then terminates every rank), SIGKILL its group after `grace_s`."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch_job(state: ClusterState, command: Sequence[str], *, name: str, ranks_per_node: int = 1,
               nodes: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
               log: Path | None = None, verbose: int = 0, nice: int = 0) -> ClusterJob:
    """Start `command` as one Horovod job with `ranks_per_node` ranks on each of `nodes` (default: all).

    Ranks are numbered node by node (ranks 0..k-1 on the first node), as `horovodrun -H` does.
    Each rank gets `CROSSOVER_SOCKET` of its node's daemon and `CROSSOVER_JOB_NAME=name`.
    """
    if not command:
        raise ClusterError("no command to run")
    if ranks_per_node < 1:
        raise ClusterError(f"ranks_per_node={ranks_per_node} must be ≥ 1")
    chosen = [state.nodes[i] for i in (range(len(state.nodes)) if nodes is None else nodes)]
    if not chosen:
        raise ClusterError("a job needs at least one node")
    jobs_dir = Path(state.workdir) / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^\w.-]", "_", name)
    np = ranks_per_node * len(chosen)
    spec: dict[str, Any] = {
        "command": list(command),
        "hosts": ",".join(f"{n.hostname}:{ranks_per_node}" for n in chosen),
        "np": np,
        "server_ip": state.hub_address,
        "iface": IFACE,
        "verbose": verbose,
        "nice": nice,
        "nodes": {n.hostname: {"netns": n.netns, "env": {"CROSSOVER_SOCKET": n.socket, "CROSSOVER_NODE": n.name}}
                  for n in chosen},
    }
    spec_path = jobs_dir / f"{safe}.{os.getpid()}.{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    log = log or jobs_dir / f"{safe}.log"
    job_env = {k: v for k, v in os.environ.items() if k not in _PER_NODE_ENV}
    job_env.update(env or {})
    job_env.setdefault("CROSSOVER_JOB_NAME", name)
    job_env["PYTHONUNBUFFERED"] = "1"
    job_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), job_env.get("PYTHONPATH")]))
    argv = ["ip", "netns", "exec", state.hub_netns, *_python_m("tools.cluster", "launch", str(spec_path))]
    proc = _popen(argv, log, job_env)
    return ClusterJob(name, proc, log, np)


def _launch_in_hub(spec_path: str) -> int:
    """Runs inside the hub namespace: Horovod's Gloo launcher with an `ip netns exec` per slot."""
    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.common.util.settings import Settings
    from horovod.runner.gloo_run import launch_gloo

    spec = json.loads(Path(spec_path).read_text())
    nodes: dict[str, dict[str, Any]] = spec["nodes"]
    settings = Settings(hosts=spec["hosts"], num_proc=spec["np"], verbose=spec["verbose"], nics={spec["iface"]},
                        output_filename=None, elastic=False, prefix_output_with_timestamp=False)
    ip = shutil.which("ip") or "ip"
    terminate_all = threading.Event()

    def exec_command(command: str, slot_info: Any, events: list[threading.Event] | None) -> tuple[int, float]:
        # Horovod's `_exec_command_fn` minus ssh: the slot's host is a namespace on this machine.
        node = nodes[slot_info.hostname]
        node_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in node["env"].items())
        niced = f"nice -n {int(spec.get('nice', 0))} " if spec.get("nice") else ""
        wrapped = f"{ip} netns exec {shlex.quote(node['netns'])} {niced}env {node_env} {command}"
        if settings.verbose:
            print(wrapped, flush=True)
        all_events = [*(events or []), terminate_all]
        try:
            code = safe_shell_exec.execute(wrapped, index=slot_info.rank, events=all_events)
        except Exception as exc:  # noqa: BLE001 - mirror Horovod: a failed slot fails the job
            print(f"slot {slot_info.rank}: launch failed: {exc}", flush=True)
            code = 1
        if code != 0:
            print(f"Process {slot_info.rank} exit with status code {code}.", flush=True)
            if not terminate_all.is_set():
                print(f"Terminating remaining workers after failure of Process {slot_info.rank}.", flush=True)
            terminate_all.set()
        return code, time.time()

    env = {k: v for k, v in os.environ.items() if k not in _PER_NODE_ENV}
    try:
        launch_gloo(spec["command"], exec_command, settings, [spec["iface"]], env, spec["server_ip"])
    except RuntimeError as exc:
        print(f"tools.cluster: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- the cluster ----------------------------------------------------------------------------------------

_live: list[Cluster] = []
_live_lock = threading.Lock()
_handlers_installed = False
_counter = iter(range(1_000_000))


def _down_all() -> None:
    with _live_lock:
        clusters = list(_live)
    for c in clusters:
        try:
            c.down()
        except Exception:  # noqa: BLE001 - at exit, clean what can be cleaned
            _log.exception("teardown of cluster %s failed", c.prefix)


def _install_signal_handlers() -> None:
    """SIGTERM/SIGHUP raise SystemExit in the main thread, so `with` blocks and `finally` tear down.

    A handler someone else installed is kept and called after our teardown.
    Ctrl-C already raises KeyboardInterrupt; atexit is the last resort.
    """
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    atexit.register(_down_all)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A background job of a non-interactive shell starts with SIGINT ignored, and
        # Python then installs no Ctrl-C handler; our promise is that Ctrl-C tears down.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            if callable(previous):
                _down_all()
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:
                raise SystemExit(128 + signum)

        signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Block the signals that trigger teardown for the calling thread; pending ones arrive on exit."""
    sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Cluster:
    """Builds, owns and tears down an emulated cluster. Use as a context manager.

    >>> with Cluster(ClusterSpec(nodes=2, link=Link(rate_mbit=200), policy="crossover")) as c:
    ...     job = c.run([sys.executable, "train.py"], name="a")
    ...     assert job.wait(300) == 0
    """

    def __init__(self, spec: ClusterSpec | None = None, workdir: str | Path | None = None, name: str | None = None,
                 keep_workdir: bool = True) -> None:
        self.spec = spec or ClusterSpec()
        self.prefix = f"xo{os.getpid()}c{next(_counter)}"
        self.name = name
        if workdir is None and name:
            workdir = STATE_ROOT / name
        self._own_tmp = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"crossover-{self.prefix}-"))
        self.keep_workdir = keep_workdir
        self.state: ClusterState | None = None
        self._links: list[Link] = [self.spec.link_of(i) for i in range(self.spec.nodes)]
        self._daemons: list[subprocess.Popen] = []
        self._jobs: list[ClusterJob] = []
        self._created: list[str] = []  # namespaces, in creation order
        self._lock = threading.RLock()
        self._down = False

    # ---- lifecycle ----

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        except ClusterError:
            if exc[0] is None:
                raise
            _log.exception("teardown after an error also failed")

    def up(self, ready_timeout_s: float = 20.0) -> Cluster:
        """Create namespaces, bridge, shaped links and daemons; on any failure, undo what was made and raise."""
        reasons = preflight()
        if reasons:
            raise Unsupported("cannot build an emulated cluster: " + "; ".join(reasons))
        if any(link.needs_netem for link in self._links) and not netem_available():
            raise Unsupported("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay and jitter "
                              "cannot be emulated here; rate shaping (tbf) works: drop the delay")
        _install_signal_handlers()
        with _live_lock:
            _live.append(self)
        try:
            self._build(ready_timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _build(self, ready_timeout_s: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        hub = f"{self.prefix}h"
        self._add_ns(hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{SUBNET}.{HUB_HOST}/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        nodes = []
        for i in range(self.spec.nodes):
            ns = f"{self.prefix}n{i}"
            self._add_ns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # veth created in the hub with its peer born inside the node: nothing touches the root namespace.
            _ip("-n", hub, "link", "add", f"n{i}", "type", "veth", "peer", "name", IFACE, "netns", ns)
            _ip("-n", hub, "link", "set", f"n{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            self._apply(i, hub, ns)
            self._write_hosts(ns, i)
            core = self.spec.core_of(i)
            nodes.append(Node(index=i, name=f"node{i}", netns=ns, address=f"{SUBNET}.{i + 1}", core=core,
                              socket=str(self.workdir / f"node{i}.sock"),
                              event_log=str(self.workdir / f"node{i}.events.jsonl"),
                              log=str(self.workdir / f"node{i}.log")))
        self.state = ClusterState(prefix=self.prefix, hub_netns=hub, hub_address=f"{SUBNET}.{HUB_HOST}",
                                  workdir=str(self.workdir), owner_pid=os.getpid(), policy=self.spec.policy,
                                  nodes=tuple(nodes), links=tuple(self._links))
        for n in nodes:
            # `--cpu-devices 1` would mean "one device, core 0": a single core id is spelt as a range.
            self._daemons.append(_popen(
                ["ip", "netns", "exec", n.netns, *(["nice", "-n", str(self.spec.nice)] if self.spec.nice else []),
                 *_python_m("crossover.daemon.main"),
                 "--socket", n.socket, "--cpu-devices", f"{n.core}-{n.core}", "--policy", self.spec.policy,
                 "--node-name", n.name, "--event-log", n.event_log, "--log-level", "WARNING",
                 "--heartbeat-timeout", str(self.spec.heartbeat_timeout_s), *self.spec.daemon_args],
                Path(n.log)))
        for n, proc in zip(nodes, self._daemons):
            self._wait_daemon(n, proc, ready_timeout_s)
        (self.workdir / "cluster.json").write_text(json.dumps(self.state.to_json(), indent=2))
        _log.info("cluster %s up: %d nodes, %s", self.prefix, len(nodes), ", ".join(x.describe() for x in self._links))

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        # IPv4 only: Gloo must not pick the interface's link-local IPv6 address.
        _in_ns(ns, "sh", "-c", "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
               "/proc/sys/net/ipv6/conf/default/disable_ipv6; do [ -w $f ] && echo 1 > $f; done; true", check=False)

    def _write_hosts(self, ns: str, i: int) -> None:
        """`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over /etc/hosts inside the node.

        It maps this machine's host name to the node's own address. Horovod 0.28.1
        builds the Gloo device of every process set (the global one included) from
        `gethostname()` instead of HOROVOD_GLOO_IFACE; without this the name resolves
        to 127.0.0.1 and ranks on other nodes get "connect [127.0.0.1]: Connection refused".
        """
        etc = _ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        me = os.uname().nodename
        lines = ["127.0.0.1 localhost", f"{SUBNET}.{i + 1} {me} {ns} node{i}"]
        lines += [f"{SUBNET}.{j + 1} {self.prefix}n{j} node{j}" for j in range(self.spec.nodes) if j != i]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _apply(self, i: int, hub: str, ns: str) -> None:
        link = self._links[i]
        _apply_link(ns, IFACE, link)  # uploads from node i
        _apply_link(hub, f"n{i}", link)  # downloads to node i

    @staticmethod
    def _wait_daemon(node: Node, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"crossoverd of {node.name} exited {proc.returncode}: "
                                   f"{Path(node.log).read_text(errors='replace')[-2000:]}")
            if os.path.exists(node.socket) and _daemon_answers(node.socket):
                return
            time.sleep(0.05)
        raise ClusterError(f"crossoverd of {node.name} did not answer on {node.socket} within {timeout:.0f}s; "
                           f"log {node.log}")

    def down(self, grace_s: float = 5.0) -> None:
        """Stop every job, daemon and process in our namespaces, then delete the namespaces. Idempotent.

        SIGTERM/SIGINT/SIGHUP are held back while it runs (delivered right after), so a second
        Ctrl-C cannot leave half a cluster behind.
        """
        with self._lock, _signals_deferred():
            if self._down:
                return
            self._down = True
            for job in self._jobs:
                with contextlib.suppress(Exception):
                    job.stop(grace_s)
            for proc in self._daemons:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
            for proc in self._daemons:
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            problems = []
            for ns in reversed(self._created):
                left = _kill_ns_processes(ns, grace_s=2.0)
                if left:
                    problems.append(f"processes {left} in {ns} survived SIGKILL")
                res = _ip("netns", "delete", ns, check=False)
                shutil.rmtree(_ETC_NETNS / ns, ignore_errors=True)
                if res.returncode != 0 and ns in _netns_list():
                    problems.append(f"cannot delete namespace {ns}: {res.stderr.strip()}")
            for proc in self._daemons + [j.proc for j in self._jobs]:
                with contextlib.suppress(Exception):
                    proc.wait(1)
            with _live_lock:
                if self in _live:
                    _live.remove(self)
            if self._own_tmp and not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            elif self.state is not None:
                with contextlib.suppress(OSError):
                    (self.workdir / "cluster.json").unlink()
            if problems:
                raise ClusterError("teardown incomplete: " + "; ".join(problems))

    # ---- use ----

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._require().nodes

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    def _require(self) -> ClusterState:
        if self.state is None or self._down:
            raise ClusterError("the cluster is not up")
        return self.state

    def run(self, command: Sequence[str], *, name: str, ranks_per_node: int = 1,
            nodes: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
            log: Path | None = None, verbose: int = 0) -> ClusterJob:
        """Start one Horovod job across the cluster (see `launch_job`); it is stopped at teardown."""
        job = launch_job(self._require(), command, name=name, ranks_per_node=ranks_per_node, nodes=nodes,
                         env=env, log=log, verbose=verbose, nice=self.spec.nice)
        self._jobs.append(job)
        return job

    def shape(self, node: int, link: Link) -> None:
        """Change one node's link (both directions) while the cluster runs."""
        state = self._require()
        if not 0 <= node < len(state.nodes):
            raise ClusterError(f"node {node} does not exist (0..{len(state.nodes) - 1})")
        if link.needs_netem and not netem_available():
            raise Unsupported("this kernel has no netem qdisc: link delay and jitter cannot be emulated here")
        self._links[node] = link
        self._apply(node, state.hub_netns, state.nodes[node].netns)
        self.state = replace(state, links=tuple(self._links))

    def link(self, node: int) -> Link:
        return self._links[node]

    def exec(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a command inside a node's namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self._require().nodes[node].netns, *argv], **kwargs)

    def pids(self, node: int) -> list[int]:
        """Every process inside a node's namespace (its daemon, the ranks placed there)."""
        return _ns_pids(self._require().nodes[node].netns)

    def events(self, node: int) -> list[dict[str, Any]]:
        """That node's daemon event log (JSON lines) as it stands now; still readable after teardown."""
        from crossover.daemon.event_log import read_jsonl

        if self.state is None:
            raise ClusterError("the cluster was never built")
        path = self.state.nodes[node].event_log
        return read_jsonl(path) if os.path.exists(path) else []


def _daemon_answers(socket_path: str, timeout: float = 2.0) -> bool:
    try:
        import grpc

        from crossover.protos import crossover_v1_pb2 as pb
        from crossover.protos import crossover_v1_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix://{socket_path}") as ch:
            pb_grpc.AdminStub(ch).GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ---- measurement -----------------------------------------------------------------------------------------

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None; buf = bytearray(1 << 20)
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.monotonic()
    n += k
print(n, time.monotonic() - t0, flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
chunk = b"x" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    c.sendall(chunk[:min(left, len(chunk))]); left -= len(chunk)
c.close()
"""


def measure_throughput(state: ClusterState, src: int, dst: int, megabytes: float = 20.0, port: int = 5201) -> float:
    """Mbit/s of one TCP stream from node `src` to node `dst`, timed at the receiver (first byte to EOF)."""
    a, b = state.nodes[src], state.nodes[dst]
    sink = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c", _SINK, b.address, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise ClusterError(f"throughput sink did not start: {sink.stderr.read() if sink.stderr else ''}")
        _in_ns(a.netns, sys.executable, "-c", _SOURCE, b.address, str(port), str(int(megabytes * 1e6)))
        out, err = sink.communicate(timeout=120)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    try:
        nbytes, seconds = out.split()
    except ValueError:
        raise ClusterError(f"throughput sink gave no result: {out!r} {err!r}") from None
    return int(nbytes) * 8 / float(seconds) / 1e6


# ---- stale clusters ----------------------------------------------------------------------------------------


def cleanup_stale(dry_run: bool = False) -> list[str]:
    """Delete namespaces `xo<pid>c<k>*` whose owning process is gone (and kill what runs inside them)."""
    removed = []
    for ns in sorted(_netns_list()):
        m = _NS_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        removed.append(ns)
        if not dry_run:
            _kill_ns_processes(ns, grace_s=2.0)
            _ip("netns", "delete", ns, check=False)
            shutil.rmtree(_ETC_NETNS / ns, ignore_errors=True)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _down_state(state: ClusterState) -> list[str]:
    """Tear down a cluster from its state file (its owner is gone or asked us to)."""
    names = [state.hub_netns, *(n.netns for n in state.nodes)]
    present = _netns_list()
    for ns in reversed(names):
        if ns in present:
            _kill_ns_processes(ns, grace_s=3.0)
            _ip("netns", "delete", ns, check=False)
        shutil.rmtree(_ETC_NETNS / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        (Path(state.workdir) / "cluster.json").unlink()
    return [ns for ns in names if ns in present]


# ---- CLI ---------------------------------------------------------------------------------------------------


def _cli() -> Any:
    import click

    def link_opts(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--jitter", type=float, default=0.0, show_default=True, help="Delay jitter, ms (netem).")(f)
        f = click.option("--delay", type=float, default=0.0, show_default=True,
                         help="One-way delay of each node's link, ms (needs the kernel's netem).")(f)
        f = click.option("--rate", default="200mbit", show_default=True,
                         help="Each node's link rate, both directions (tbf): 200mbit, 1gbit, 0 = unshaped.")(f)
        return f

    def spec_from(nodes: int, rate: str, delay: float, jitter: float, node_rate: tuple[str, ...],
                  node_delay: tuple[str, ...], cores: str | None, policy: str,
                  daemon_arg: tuple[str, ...], nice: int) -> ClusterSpec:
        base = Link(parse_rate(rate), delay, jitter)
        links: dict[int, Link] = {}
        for item in node_rate:
            i, _, r = item.partition("=")
            links[int(i)] = replace(links.get(int(i), base), rate_mbit=parse_rate(r))
        for item in node_delay:
            i, _, d = item.partition("=")
            links[int(i)] = replace(links.get(int(i), base), delay_ms=float(d))
        core_list = tuple(int(c) for c in cores.split(",")) if cores else ()
        return ClusterSpec(nodes=nodes, link=base, links=links, cores=core_list, policy=policy,
                           daemon_args=daemon_arg, nice=nice)

    def cluster_opts(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--daemon-arg", multiple=True, help="Extra crossoverd argument (repeatable).")(f)
        f = click.option("--nice", type=click.IntRange(-20, 19), default=0, show_default=True,
                         help="Niceness of daemons and ranks; negative makes the emulated devices outrank "
                              "other work on their cores.")(f)
        f = click.option("--policy", default="crossover", show_default=True,
                         help="crossoverd --policy on every node.")(f)
        f = click.option("--cores", help="Core of each node, e.g. 0,1 (default: usable cores, round-robin).")(f)
        f = click.option("--node-delay", multiple=True, metavar="I=MS", help="Override one node's delay.")(f)
        f = click.option("--node-rate", multiple=True, metavar="I=RATE",
                         help="Override one node's rate (thinner link).")(f)
        f = link_opts(f)
        f = click.option("--nodes", type=click.IntRange(1, 200), default=2, show_default=True)(f)
        return f

    class _Fail(click.ClickException):
        def show(self, file: Any = None) -> None:
            click.echo(f"tools.cluster: {self.format_message()}", err=True)

    @click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
    @click.option("--log-level", default="WARNING", show_default=True)
    def cli(log_level: str) -> None:
        """Emulated cluster: one network namespace per node, tc-shaped links, one crossoverd per node."""
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    @cli.command()
    @cluster_opts
    @click.option("--name", help="Register under /run/crossover/clusters/NAME for `run --cluster NAME`.")
    @click.option("--workdir", type=click.Path(file_okay=False), help="Sockets, event logs and job logs go here.")
    def up(name: str | None, workdir: str | None, **kw: Any) -> None:
        """Build a cluster and keep it until Ctrl-C or SIGTERM (then tear it down)."""
        try:
            cluster = Cluster(spec_from(**kw), workdir=workdir, name=name)
            cluster.up()
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        try:
            state = cluster._require()
            click.echo(f"cluster {name or state.prefix} up in {state.workdir}")
            for n, link in zip(state.nodes, state.links):
                click.echo(f"  {n.name}: netns {n.netns}  {n.address}  core {n.core}  {link.describe()}  "
                           f"CROSSOVER_SOCKET={n.socket}")
            click.echo(f"jobs: python -m tools.cluster run --cluster {name or state.workdir} -- CMD ...   "
                       "(Ctrl-C here tears down)", err=True)
            sys.stdout.flush()
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.down()
            click.echo("cluster torn down", err=True)

    @cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
    @click.option("--cluster", "cluster_ref",
                  help="A running cluster (name or work dir); default: build one for this job.")
    @cluster_opts
    @click.option("-np", "--ranks-per-node", "rpn", type=click.IntRange(1), default=1, show_default=True,
                  help="Ranks of the job on each node.")
    @click.option("--job-name", default="job", show_default=True)
    @click.option("--verbose", is_flag=True)
    @click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
    def run(cluster_ref: str | None, rpn: int, job_name: str, verbose: bool, command: tuple[str, ...],
            **kw: Any) -> None:
        """Run one Horovod job (COMMAND) across all nodes; its output is printed as it comes."""
        try:
            if cluster_ref:
                state = ClusterState.load(cluster_ref)
                code = _follow(launch_job(state, command, name=job_name, ranks_per_node=rpn, verbose=int(verbose),
                                          nice=kw["nice"]))
            else:
                with Cluster(spec_from(**kw)) as cluster:
                    code = _follow(cluster.run(command, name=job_name, ranks_per_node=rpn, verbose=int(verbose)))
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        sys.exit(code)

    @cli.command()
    @click.option("--cluster", "cluster_ref", required=True)
    @click.option("--node", type=int, required=True)
    @link_opts
    def shape(cluster_ref: str, node: int, rate: str, delay: float, jitter: float) -> None:
        """Change one node's link of a running cluster."""
        try:
            state = ClusterState.load(cluster_ref)
            if not 0 <= node < len(state.nodes):
                raise ClusterError(f"node {node} does not exist (0..{len(state.nodes) - 1})")
            link = Link(parse_rate(rate), delay, jitter)
            _apply_link(state.nodes[node].netns, IFACE, link)
            _apply_link(state.hub_netns, f"n{node}", link)
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        click.echo(f"node{node}: {link.describe()}")

    @cli.command()
    @click.argument("cluster_ref", required=False)
    @click.option("--stale", is_flag=True, help="Remove every xo<pid>c<k>* namespace whose owner process is gone.")
    def down(cluster_ref: str | None, stale: bool) -> None:
        """Tear down a cluster by name/work dir (SIGTERM its owner), or clean up after crashed owners."""
        if not cluster_ref and not stale:
            raise click.UsageError("give a cluster name/work dir, or --stale")
        try:
            if cluster_ref:
                state = ClusterState.load(cluster_ref)
                owner = state.owner_pid != os.getpid() and _pid_alive(state.owner_pid)
                if owner:
                    os.kill(state.owner_pid, signal.SIGTERM)
                    deadline = time.monotonic() + 20
                    while _pid_alive(state.owner_pid) and time.monotonic() < deadline:
                        time.sleep(0.1)
                removed = _down_state(state)
                if removed:
                    click.echo(f"removed {' '.join(removed)}")
                else:
                    click.echo(f"{cluster_ref} is down" + (f" (its owner, pid {state.owner_pid}, tore it down)"
                                                           if owner else ""))
            if stale:
                removed = cleanup_stale()
                click.echo(f"stale namespaces removed: {' '.join(removed) or 'none'}")
        except ClusterError as exc:
            raise _Fail(str(exc)) from None

    @cli.command(name="ls")
    def ls_() -> None:
        """List registered clusters and namespaces this tool made."""
        for f in sorted(STATE_ROOT.glob("*/cluster.json")) if STATE_ROOT.exists() else []:
            st = ClusterState.from_json(json.loads(f.read_text()))
            alive = "running" if _pid_alive(st.owner_pid) else "owner gone"
            click.echo(f"{f.parent.name}: {len(st.nodes)} nodes, policy {st.policy}, {alive}, {st.workdir}")
        ours = sorted(ns for ns in _netns_list() if _NS_RE.match(ns))
        click.echo(f"namespaces: {' '.join(ours) or 'none'}")

    @cli.command(hidden=True)
    @click.argument("spec_path")
    def launch(spec_path: str) -> None:
        """Internal: Horovod's Gloo launcher inside the hub namespace."""
        sys.exit(_launch_in_hub(spec_path))

    return cli


def _follow(job: ClusterJob) -> int:
    """Stream a job's log to stdout until it ends; Ctrl-C stops the job."""
    pos = 0
    try:
        while True:
            done = job.poll() is not None
            text = job.output()
            if len(text) > pos:
                sys.stdout.write(text[pos:])
                sys.stdout.flush()
                pos = len(text)
            if done:
                return job.proc.returncode
            time.sleep(0.2)
    finally:
        job.stop()


def main(argv: Sequence[str] | None = None) -> None:
    _cli()(args=list(argv) if argv is not None else None, prog_name="python -m tools.cluster")


if __name__ == "__main__":
    main()

