"""Link shaping with tc (rate: `tbf`; delay and jitter: `netem`), and measuring what a link carries."""
from __future__ import annotations

import logging
import shlex
import subprocess
import sys

from .netns import in_ns
from .spec import IFACE, ClusterError, ClusterState, Link, Node, Unsupported

_log = logging.getLogger(__name__)


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
        cmds.append(["tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{rate_bps:.0f}bit",
                     "burst", str(_tbf_burst(rate_bps)), "latency", f"{_TBF_LATENCY_MS}ms"])
    return cmds


_TBF_LATENCY_MS = 100  # the tbf's queue: 100 ms of the link's rate, so TCP is not starved by drops
LOWER_EFFORT_DSCP = 8  # CS1: what `CROSSOVER_LOW_DSCP` marks a low job's traffic with by default


def _tbf_burst(rate_bps: float) -> int:
    """The tbf's bucket: at least one 64 KiB GSO packet plus headers. A smaller bucket makes tbf segment every
    GSO packet in software: about half a core of softirq at 320 Mbit/s, taken from the cores that emulate the
    devices, against ~0.01 core with 96 KiB."""
    return max(96 * 1024, int(rate_bps / 8 * 0.001))


def _tbf_limit(rate_mbit: float) -> int:
    """The bytes the tbf queues, as `_tc_commands` sets it up: rate x latency + burst."""
    rate_bps = rate_mbit * 1e6
    return int(rate_bps / 8 * _TBF_LATENCY_MS / 1000) + _tbf_burst(rate_bps)


def _band_commands(dev: str, link: Link) -> list[list[str]]:
    """tc calls that put two bands under a shaped link's tbf: an `htb` whose two classes (each a bfifo of the
    tbf's own size) may both send far above the link's rate, so htb serves the one of lower `prio` first
    whenever both have packets. Every packet goes to the first band, so the link still has one FIFO, until
    `dscp_filter_command` sends marked packets to the second, which is sent only when the first is empty.
    (htb, because the kernels seen here lack `prio` and `ets`.)"""
    if not link.rate_mbit:
        return []
    limit = str(_tbf_limit(link.rate_mbit))
    far = f"{link.rate_mbit * 10}mbit"
    cmds = [["tc", "qdisc", "add", "dev", dev, "parent", "10:1" if link.needs_netem else "1:1", "handle", "30:",
             "htb", "default", "2"]]
    for band, prio in ((2, 0), (3, 1)):
        cmds += [["tc", "class", "add", "dev", dev, "parent", "30:", "classid", f"30:{band}", "htb", "rate", far,
                  "prio", str(prio)],
                 ["tc", "qdisc", "add", "dev", dev, "parent", f"30:{band}", "bfifo", "limit", limit]]
    return cmds


def port_commands(dev: str, port: int, rate_mbit: float) -> list[list[str]]:
    """tc calls that give the TCP traffic of one `port` on `dev` (to it and from it, each way its own class) a link
    of `rate_mbit` and leave every other packet unshaped (htb's direct queue): on a namespace's loopback, a
    service behind a thin link while everything else stays local."""
    rate_bps = rate_mbit * 1e6
    burst, limit = str(_tbf_burst(rate_bps)), str(_tbf_limit(rate_mbit))
    cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]]
    for band, match in ((10, "dport"), (20, "sport")):
        cmds += [["tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{band}", "htb", "rate",
                  f"{rate_bps:.0f}bit", "ceil", f"{rate_bps:.0f}bit", "burst", burst, "cburst", burst],
                 ["tc", "qdisc", "add", "dev", dev, "parent", f"1:{band}", "bfifo", "limit", limit],
                 ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                  "ip", match, str(port), "0xffff", "flowid", f"1:{band}"]]
    return cmds


def shape_port(ns: str, port: int, rate_mbit: float) -> None:
    """Bring up namespace `ns`'s loopback and give its TCP port `port` a link of `rate_mbit` each way
    (`port_commands`); every other packet stays unshaped."""
    for cmd in [["ip", "link", "set", "lo", "up"], *port_commands("lo", port, rate_mbit)]:
        in_ns(ns, *cmd)


def dscp_filter_command(dev: str, on: bool, dscp: int = LOWER_EFFORT_DSCP) -> list[str]:
    """The tc call that sends packets marked `dscp` to a shaped link's last band (on), or takes it back (off):
    what a node qdisc or a switch that honours DSCP does."""
    if not on:
        return ["tc", "filter", "del", "dev", dev, "parent", "30:", "prio", "1"]
    return ["tc", "filter", "add", "dev", dev, "parent", "30:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "tos", hex(dscp << 2), "0xfc", "flowid", "30:3"]


def set_dscp_bands(hub_ns: str, node_ns: str, index: int, link: Link, on: bool, dscp: int = LOWER_EFFORT_DSCP) -> None:
    """Node `index`'s shaped link, both ways, sends packets marked `dscp` after all others (on), or treats every
    packet alike (off)."""
    if not link.rate_mbit:
        return
    for ns, dev in ((node_ns, IFACE), (hub_ns, f"n{index}")):
        cmd = dscp_filter_command(dev, on, dscp)
        res = in_ns(ns, *cmd, check=False)
        if res.returncode != 0 and on:
            raise Unsupported(f"tc on {ns}/{dev} cannot give DSCP {dscp} a band of its own (`{shlex.join(cmd)}`: "
                              f"{(res.stderr or res.stdout).strip()}): this kernel needs the htb qdisc and the u32 "
                              "filter")


def apply_link(ns: str, dev: str, link: Link) -> None:
    in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    for cmd in _tc_commands(dev, link):
        res = in_ns(ns, *cmd, check=False)
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            if "netem" in cmd and "unknown" in msg.lower():
                raise Unsupported("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay and jitter "
                                  "cannot be emulated here; rate shaping (tbf) works: drop --delay/--jitter")
            raise ClusterError(f"tc on {ns}/{dev} failed: `{shlex.join(cmd)}`: {msg}")
    for cmd in _band_commands(dev, link):  # without them the link is one FIFO, as tbf alone makes it
        res = in_ns(ns, *cmd, check=False)
        if res.returncode != 0:
            _log.warning("tc on %s/%s: no DSCP bands (`%s`: %s)", ns, dev, shlex.join(cmd),
                         (res.stderr or res.stdout).strip())
            break


def shape_node(hub_ns: str, node_ns: str, index: int, link: Link) -> None:
    """Shape node `index`'s link both ways: its uploads on its own side, its downloads on the hub's."""
    apply_link(node_ns, IFACE, link)
    apply_link(hub_ns, f"n{index}", link)


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
    procs: list[subprocess.Popen] = []
    try:
        sink = _sink(b, procs, _SINK, str(port))
        in_ns(a.netns, sys.executable, "-c", _SOURCE, b.address, str(port), str(int(megabytes * 1e6)))
        out, err = sink.communicate(timeout=120)
    finally:
        _stop(procs)
    try:
        nbytes, seconds = out.split()
    except ValueError:
        raise ClusterError(f"throughput sink gave no result: {out!r} {err!r}") from None
    return int(nbytes) * 8 / float(seconds) / 1e6


def _sink(node: Node, procs: list[subprocess.Popen], script: str, *args: str) -> subprocess.Popen:
    """A receiver (`script`, its address and `args` on its command line) in `node`'s namespace, once it
    listens: it says "ready" on its stdout first. Added to `procs` as soon as it runs, for `_stop`."""
    sink = subprocess.Popen(["ip", "netns", "exec", node.netns, sys.executable, "-c", script, node.address, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(sink)
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != "ready":
        raise ClusterError(f"throughput sink did not start: {sink.stderr.read() if sink.stderr else ''}")
    return sink


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


_TIMED_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.settimeout(0.1); n = 0; buf = bytearray(1 << 20); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        k = c.recv_into(buf)
    except socket.timeout:
        continue
    if not k: break
    n += k
print(n, flush=True)
"""
_MARKED_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(sys.argv[3]) << 2)
chunk = b"x" * (1 << 20); end = time.monotonic() + float(sys.argv[4])
try:
    while time.monotonic() < end: c.sendall(chunk)
except OSError: pass
"""


def measure_side_by_side(state: ClusterState, src: int, dst: int, dscps: tuple[int, ...], seconds: float = 3.0,
                         port: int = 5301) -> list[float]:
    """Mbit/s of TCP streams from node `src` to node `dst` at once, one per DSCP in `dscps`, over `seconds`."""
    a, b = state.nodes[src], state.nodes[dst]
    procs: list[subprocess.Popen] = []
    try:
        sinks = [_sink(b, procs, _TIMED_SINK, str(port + k), str(seconds)) for k in range(len(dscps))]
        procs += [subprocess.Popen(["ip", "netns", "exec", a.netns, sys.executable, "-c", _MARKED_SOURCE, b.address,
                                    str(port + k), str(dscp), str(seconds + 1)]) for k, dscp in enumerate(dscps)]
        received = [int(sink.communicate(timeout=seconds + 30)[0]) for sink in sinks]
    finally:
        _stop(procs)
    return [n * 8 / seconds / 1e6 for n in received]
