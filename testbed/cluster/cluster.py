"""The cluster: builds, owns and tears down an emulated cluster, also on signals and at interpreter exit."""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from crossover.protos.event_file import Event
from testbed.harness.daemon import kill_group

from .launch import ClusterJob, launch_job, start_daemon, start_device, wait_daemon, wait_device
from .netns import (
    ETC_NETNS,
    add_bridge,
    add_node_link,
    disable_ipv6,
    ip,
    kill_ns_processes,
    netem_available,
    netns_list,
    ns_pids,
    preflight,
    write_hosts,
)
from .shaping import LOWER_EFFORT_DSCP, set_dscp_bands, shape_node
from .spec import HUB_HOST, STATE_ROOT, SUBNET, ClusterError, ClusterSpec, ClusterState, Link, Node, Unsupported

_log = logging.getLogger("testbed.cluster")  # the test bed logs under its package name

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
        add_bridge(hub)
        nodes = []
        for i in range(self.spec.nodes):
            ns = f"{self.prefix}n{i}"
            self._add_ns(ns)
            add_node_link(hub, ns, i)
            self._apply(i, hub, ns)
            write_hosts(self.prefix, ns, i, self.spec.nodes)
            core = self.spec.core_of(i)
            nodes.append(Node(index=i, name=f"node{i}", netns=ns, address=f"{SUBNET}.{i + 1}", core=core,
                              socket=str(self.workdir / f"node{i}.sock"),
                              event_log=str(self.workdir / f"node{i}.events.jsonl"),
                              log=str(self.workdir / f"node{i}.log"),
                              device_socket=str(self.workdir / f"node{i}.device.sock") if self.spec.device_model
                              else ""))
        self.state = ClusterState(prefix=self.prefix, hub_netns=hub, hub_address=f"{SUBNET}.{HUB_HOST}",
                                  workdir=str(self.workdir), owner_pid=os.getpid(), policy=self.spec.policy,
                                  nodes=tuple(nodes), links=tuple(self._links))
        if self.spec.device_model:
            devices = [start_device(n, self.spec) for n in nodes]
            self._daemons.extend(devices)
            for n, proc in zip(nodes, devices):
                wait_device(n, proc, ready_timeout_s)
        for n in nodes:
            self._daemons.append(start_daemon(n, self.spec))
        for n, proc in zip(nodes, self._daemons[-len(nodes):]):
            wait_daemon(n, proc, ready_timeout_s)
        (self.workdir / "cluster.json").write_text(json.dumps(self.state.to_json(), indent=2))
        _log.info("cluster %s up: %d nodes, %s", self.prefix, len(nodes), ", ".join(x.describe() for x in self._links))

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._created.append(ns)
        disable_ipv6(ns)

    def _apply(self, i: int, hub: str, ns: str) -> None:
        shape_node(hub, ns, i, self._links[i])

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
                    kill_group(proc)
            problems = []
            for ns in reversed(self._created):
                left = kill_ns_processes(ns, grace_s=2.0)
                if left:
                    problems.append(f"processes {left} in {ns} survived SIGKILL")
                res = ip("netns", "delete", ns, check=False)
                shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
                if res.returncode != 0 and ns in netns_list():
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
            log: Path | None = None, verbose: int = 0, framework: str = "horovod") -> ClusterJob:
        """Start one job across the cluster (see `launch_job`); it is stopped at teardown."""
        job = launch_job(self._require(), command, name=name, ranks_per_node=ranks_per_node, nodes=nodes,
                         env=env, log=log, verbose=verbose, nice=self.spec.nice, framework=framework)
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

    def honour_dscp(self, on: bool, dscp: int = LOWER_EFFORT_DSCP) -> None:
        """Every shaped link sends packets marked `dscp` (a low job's, `CROSSOVER_LOW_DSCP`) after all others
        (on), or treats every packet alike (off: the default, one FIFO per link)."""
        state = self._require()
        for i, node in enumerate(state.nodes):
            set_dscp_bands(state.hub_netns, node.netns, i, self._links[i], on, dscp)

    def link(self, node: int) -> Link:
        return self._links[node]

    def exec(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a command inside a node's namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self._require().nodes[node].netns, *argv], **kwargs)

    def pids(self, node: int) -> list[int]:
        """Every process inside a node's namespace (its daemon, the ranks placed there)."""
        return ns_pids(self._require().nodes[node].netns)

    def events(self, node: int) -> list[Event]:
        """That node's daemon event log (typed: `crossover.protos.event_file`) as it stands now; still readable
        after teardown."""
        from crossover.protos.event_file import read_events

        if self.state is None:
            raise ClusterError("the cluster was never built")
        path = self.state.nodes[node].event_log
        return read_events(path)
