"""Network namespaces on this machine: the `ip` and `tc` commands, the hub's bridge, each node's veth, teardown."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .spec import HUB_HOST, IFACE, SUBNET, ClusterError, ClusterState, Unsupported

ETC_NETNS = Path("/etc/netns")  # per-namespace /etc overrides, see ip-netns(8)
NS_RE = re.compile(r"^xo(\d+)c(\d+)(h|n\d+)$")


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
            ip("netns", "add", ns)
            ip("-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
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


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, *argv], check=check)


def netns_list() -> set[str]:
    res = ip("netns", "list", check=False)
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


def ns_pids(ns: str) -> list[int]:
    res = ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def kill_ns_processes(ns: str, grace_s: float) -> list[int]:
    """SIGTERM everything inside `ns`, SIGKILL what is left after `grace_s`; returns pids that survived."""
    pids = ns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = ns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 3.0
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = ns_pids(ns)
    return pids


# ---- building ---------------------------------------------------------------------------------------


def disable_ipv6(ns: str) -> None:
    """IPv4 only: Gloo must not pick the interface's link-local IPv6 address."""
    in_ns(ns, "sh", "-c", "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
           "/proc/sys/net/ipv6/conf/default/disable_ipv6; do [ -w $f ] && echo 1 > $f; done; true", check=False)


def add_bridge(hub: str) -> None:
    """The hub's bridge `br0`, which every node's veth joins, with the hub's address."""
    ip("-n", hub, "link", "set", "lo", "up")
    ip("-n", hub, "link", "add", "br0", "type", "bridge")
    ip("-n", hub, "addr", "add", f"{SUBNET}.{HUB_HOST}/24", "dev", "br0")
    ip("-n", hub, "link", "set", "br0", "up")


def add_node_link(hub: str, ns: str, i: int) -> None:
    """Node i's veth: `n<i>` on the hub's bridge, its peer `eth0` inside the node with address 10.77.0.<i+1>."""
    ip("-n", ns, "link", "set", "lo", "up")
    # veth created in the hub with its peer born inside the node: nothing touches the root namespace.
    ip("-n", hub, "link", "add", f"n{i}", "type", "veth", "peer", "name", IFACE, "netns", ns)
    ip("-n", hub, "link", "set", f"n{i}", "master", "br0", "up")
    ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFACE)
    ip("-n", ns, "link", "set", IFACE, "up")


def write_hosts(prefix: str, ns: str, i: int, n_nodes: int) -> None:
    """`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over /etc/hosts inside the node.

    It maps this machine's host name to the node's own address. Horovod 0.28.1
    builds the Gloo device of every process set (the global one included) from
    `gethostname()` instead of HOROVOD_GLOO_IFACE; without this the name resolves
    to 127.0.0.1 and ranks on other nodes get "connect [127.0.0.1]: Connection refused".
    """
    etc = ETC_NETNS / ns
    etc.mkdir(parents=True, exist_ok=True)
    me = os.uname().nodename
    lines = ["127.0.0.1 localhost", f"{SUBNET}.{i + 1} {me} {ns} node{i}"]
    lines += [f"{SUBNET}.{j + 1} {prefix}n{j} node{j}" for j in range(n_nodes) if j != i]
    (etc / "hosts").write_text("\n".join(lines) + "\n")


# ---- teardown ---------------------------------------------------------------------------------------


def cleanup_stale(dry_run: bool = False) -> list[str]:
    """Delete namespaces `xo<pid>c<k>*` whose owning process is gone (and kill what runs inside them)."""
    removed = []
    for ns in sorted(netns_list()):
        m = NS_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or pid_alive(pid):
            continue
        removed.append(ns)
        if not dry_run:
            kill_ns_processes(ns, grace_s=2.0)
            ip("netns", "delete", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def down_state(state: ClusterState) -> list[str]:
    """Tear down a cluster from its state file (its owner is gone or asked us to)."""
    names = [state.hub_netns, *(n.netns for n in state.nodes)]
    present = netns_list()
    for ns in reversed(names):
        if ns in present:
            kill_ns_processes(ns, grace_s=3.0)
            ip("netns", "delete", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        (Path(state.workdir) / "cluster.json").unlink()
    return [ns for ns in names if ns in present]
