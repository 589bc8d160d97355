"""Processes in the cluster's namespaces: one crossoverd per node, and jobs (Horovod, torchrun) through the hub."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import checkout_on_path
from testbed.device_model import SOCKET_ENV
from testbed.harness.daemon import kill_group, queue_state

from .spec import IFACE, ClusterError, ClusterSpec, ClusterState, Node

_PER_NODE_ENV = ("CROSSOVER_SOCKET", "CROSSOVER_ADDRESS", "CROSSOVER_NODE", SOCKET_ENV)


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


# ---- daemons ------------------------------------------------------------------------------------------


def start_daemon(node: Node, spec: ClusterSpec) -> subprocess.Popen:
    """crossoverd inside the node's namespace, on the node's core, logging to the node's log.

    Each mode a bed measures is that mode throughout: `--no-adapt` unless `spec.daemon_args` says `--adapt`."""
    # `--cpu-devices 1` would mean "one device, core 0": a single core id is spelt as a range.
    devices = [] if node.index in spec.gpu_nodes else ["--cpu-devices", f"{node.core}-{node.core}"]
    return _popen(
        ["ip", "netns", "exec", node.netns, *(["nice", "-n", str(spec.nice)] if spec.nice else []),
         *_python_m("crossover.daemon.main"),
         "--socket", node.socket, *devices, "--policy", spec.policy,
         "--node-name", node.name, "--event-log", node.event_log, "--log-level", "WARNING",
         "--heartbeat-timeout", str(spec.heartbeat_timeout_s), "--no-adapt", *spec.daemon_args],
        Path(node.log))


def start_device(node: Node, spec: ClusterSpec) -> subprocess.Popen:
    """The node's emulated device server (`testbed.device_model.server`), logging beside the daemon's log."""
    params = spec.device_model
    assert params is not None and node.device_socket
    return _popen(_python_m("testbed.device_model.server", "--socket", node.device_socket,
                            "--slice-us", str(params.slice_us), "--switch-us", str(params.switch_us),
                            "--interference", str(params.interference)),
                  Path(node.log).with_suffix(".device.log"), {**os.environ, "PYTHONPATH": checkout_on_path(os.environ)})


def wait_device(node: Node, proc: subprocess.Popen, timeout: float) -> None:
    """Return once the node's device server has its socket; `ClusterError` if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(node.device_socket):
        if proc.poll() is not None or time.monotonic() > deadline:
            log = Path(node.log).with_suffix(".device.log")
            raise ClusterError(f"device server of {node.name} is not up (exit {proc.poll()}): "
                               f"{log.read_text(errors='replace')[-2000:] if log.exists() else ''}")
        time.sleep(0.05)


def wait_daemon(node: Node, proc: subprocess.Popen, timeout: float) -> None:
    """Return once the node's daemon answers on its socket; `ClusterError` if it exits or stays silent."""
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


def _daemon_answers(socket_path: str, timeout: float = 2.0) -> bool:
    try:
        queue_state(Path(socket_path), timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ---- jobs ---------------------------------------------------------------------------------------------


@dataclass
class ClusterJob:
    """One job across the cluster: its launcher process in the hub namespace (Horovod's Gloo runner, or one
    `torchrun` per node for a DDP job)."""

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
            kill_group(self.proc)
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch_job(state: ClusterState, command: Sequence[str], *, name: str, ranks_per_node: int = 1,
               nodes: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
               log: Path | None = None, verbose: int = 0, nice: int = 0, framework: str = "horovod") -> ClusterJob:
    """Start `command` as one job with `ranks_per_node` ranks on each of `nodes` (default: all).

    Ranks are numbered node by node (ranks 0..k-1 on the first node), as `horovodrun -H` and torchrun's
    node ranks do. Each rank gets `CROSSOVER_SOCKET` of its node's daemon and `CROSSOVER_JOB_NAME=name`.
    `framework` "horovod" runs `command` under Horovod's Gloo launcher; "ddp" runs `command` (`python
    script args...`) as `torchrun script args...` on every node, with a static rendezvous on the first
    node's address and Gloo on the cluster's interface.
    """
    if framework not in ("horovod", "ddp"):
        raise ClusterError(f"framework {framework!r} is not horovod or ddp")
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
        "framework": framework,
        "master": f"{chosen[0].address}:{_free_port()}",
        "nodes": {n.hostname: {"netns": n.netns, "env": {"CROSSOVER_SOCKET": n.socket, "CROSSOVER_NODE": n.name,
                                                         **({SOCKET_ENV: n.device_socket} if n.device_socket else {})}}
                  for n in chosen},
    }
    spec_path = jobs_dir / f"{safe}.{os.getpid()}.{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    log = log or jobs_dir / f"{safe}.log"
    job_env = {k: v for k, v in os.environ.items() if k not in _PER_NODE_ENV}
    job_env.update(env or {})
    job_env.setdefault("CROSSOVER_JOB_NAME", name)
    job_env["PYTHONUNBUFFERED"] = "1"
    job_env["PYTHONPATH"] = checkout_on_path(job_env)  # the hub's launcher imports `testbed`
    argv = ["ip", "netns", "exec", state.hub_netns, *_python_m("testbed.cluster", "launch", str(spec_path))]
    proc = _popen(argv, log, job_env)
    return ClusterJob(name, proc, log, np)


def _free_port() -> int:
    """A port for a DDP job's rendezvous: free on this machine's loopback now, so unlikely to be taken in a node."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_in_hub(spec_path: str) -> int:
    """Runs inside the hub namespace: the job's launcher, with an `ip netns exec` per node or slot."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("framework") == "ddp":
        return _torchrun_per_node(spec)
    return _horovod_gloo(spec)


def _torchrun_per_node(spec: dict[str, Any]) -> int:
    """One `torchrun` per node in its namespace, all with one static rendezvous; the first to fail ends the rest."""
    nodes: dict[str, dict[str, Any]] = spec["nodes"]
    hosts = [h.split(":")[0] for h in spec["hosts"].split(",")]
    per_node = int(spec["hosts"].split(",")[0].split(":")[1])
    addr, port = spec["master"].rsplit(":", 1)
    python, *script_args = spec["command"]
    torchrun = [python, "-m", "torch.distributed.run"]  # `torchrun`, wherever this Python's torch put it
    ip = shutil.which("ip") or "ip"
    procs = []
    for index, host in enumerate(hosts):
        node = nodes[host]
        env = {**os.environ, **node["env"], "GLOO_SOCKET_IFNAME": spec["iface"]}
        niced = ["nice", "-n", str(int(spec.get("nice", 0)))] if spec.get("nice") else []
        argv = [ip, "netns", "exec", node["netns"], *niced, *torchrun, "--nnodes", str(len(hosts)), "--node-rank",
                str(index), "--master-addr", addr, "--master-port", port, "--nproc-per-node", str(per_node),
                *script_args]
        if spec.get("verbose"):
            print(" ".join(shlex.quote(a) for a in argv), flush=True)
        procs.append(subprocess.Popen(argv, env=env))  # in the launcher's group: `ClusterJob.stop` reaches them

    def forward(signum: int, _frame: Any) -> None:  # torchrun passes it on to its workers
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and not code:
            code = failed[0]
            print(f"a node's torchrun exited with {code}; stopping the others", flush=True)
            forward(signal.SIGTERM, None)
        time.sleep(0.1)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _horovod_gloo(spec: dict[str, Any]) -> int:
    """Horovod's Gloo launcher with an `ip netns exec` per slot."""
    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.common.util.settings import Settings
    from horovod.runner.gloo_run import launch_gloo

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
        print(f"testbed.cluster: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
