"""The emulated cluster (`testbed.cluster`): namespaces, shaped links, daemons, real jobs, teardown.

Needs root, `ip` and `tc`; skips with the reason where they are missing. Under
`make test` (CROSSOVER_TEST_STRICT=1) on a machine that has them, nothing here
may skip: a cluster that cannot be built is a failure.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossover.protos.event_records import Grant
from testbed.cluster import (
    LOWER_EFFORT_DSCP,
    Cluster,
    ClusterSpec,
    Link,
    Unsupported,
    measure_side_by_side,
    measure_throughput,
    netem_available,
    preflight,
)
from testbed.harness.jobs import WORKLOADS, with_import
from testbed.harness.oracles import compute_intervals, overlaps

STRICT = os.environ.get("CROSSOVER_TEST_STRICT") == "1"
_REASONS = preflight()

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(bool(_REASONS), reason="emulated cluster unavailable: " + "; ".join(_REASONS)),
]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def cluster_factory(tmp_path):
    """Build clusters in temp dirs; a machine that cannot is a skip, or a failure under STRICT."""
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(ClusterSpec(**kw), workdir=tmp_path / f"cluster{len(made)}")
        made.append(c)
        try:
            return c.up()
        except Unsupported as exc:
            if STRICT:
                raise
            pytest.skip(f"emulated cluster unavailable: {exc}")

    yield make
    for c in made:
        c.down()
    for c in made:
        assert not set(c.namespaces) & _netns(), f"namespaces left behind: {set(c.namespaces) & _netns()}"


def _turn_agreement(ev0: list[dict], ev1: list[dict], lo: float, hi: float) -> tuple[float, int]:
    """Of consecutive grants to different jobs on node 0 (as (job, iteration)), the share node 1 made in the same
    order; and how many such pairs there were."""
    seq0 = [(e.job, Grant.of(e).iteration) for e in ev0 if e.name is Grant.name and lo <= e.t <= hi]
    pos1 = {(e.job, Grant.of(e).iteration): i for i, e in enumerate(x for x in ev1 if x.name is Grant.name)}
    seq0 = [k for k in seq0 if k in pos1]
    pairs = [(a, b) for a, b in zip(seq0, seq0[1:]) if a[0] != b[0]]
    return (sum(pos1[a] < pos1[b] for a, b in pairs) / len(pairs) if pairs else 0.0), len(pairs)


# ---- topology and links --------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_nodes_links_match_the_tc_rate(cluster_factory):
    c = cluster_factory(nodes=2, link=Link(rate_mbit=100), policy="exclusive")
    assert {n.netns for n in c.nodes} | {c.state.hub_netns} <= _netns()
    assert [n.address for n in c.nodes] == ["10.77.0.1", "10.77.0.2"]
    for n in c.nodes:  # one daemon per node, on its own socket, inside its namespace
        assert Path(n.socket).exists()
    for src, dst in ((0, 1), (1, 0)):
        mbit = measure_throughput(c.state, src, dst, megabytes=12)
        assert 75 <= mbit <= 125, f"node{src}->node{dst}: {mbit:.0f} Mbit/s on a 100 Mbit/s link"

    # A thinner node: its link caps what it receives and what it sends.
    c.shape(1, Link(rate_mbit=30))
    for src, dst in ((0, 1), (1, 0)):
        mbit = measure_throughput(c.state, src, dst, megabytes=4)
        assert 22.5 <= mbit <= 37.5, f"node{src}->node{dst}: {mbit:.0f} Mbit/s through a 30 Mbit/s node"

    # The root namespace got nothing: no 10.77.x address, no bridge of ours.
    root = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    assert "10.77." not in root


@pytest.mark.timeout(120)
def test_links_that_honour_dscp_send_the_low_class_mark_last(cluster_factory):
    c = cluster_factory(nodes=2, link=Link(rate_mbit=100), policy="exclusive")
    for src, dst in ((0, 1), (1, 0)):
        plain, marked = measure_side_by_side(c.state, src, dst, dscps=(0, LOWER_EFFORT_DSCP), seconds=1.0)
        assert plain + marked >= 70, f"node{src}->node{dst}: {plain:.0f} + {marked:.0f} Mbit/s on a 100 Mbit/s link"
    c.honour_dscp(True)
    for src, dst in ((0, 1), (1, 0)):  # both ends shaped: the sender's link and the receiver's
        plain, marked = measure_side_by_side(c.state, src, dst, dscps=(0, LOWER_EFFORT_DSCP), seconds=1.0)
        assert plain >= 0.85 * (plain + marked) and plain >= 70, \
            f"node{src}->node{dst} honouring DSCP: unmarked {plain:.0f}, marked {marked:.0f} Mbit/s"
    c.honour_dscp(False)
    plain, marked = measure_side_by_side(c.state, 0, 1, dscps=(0, LOWER_EFFORT_DSCP), seconds=1.0)
    assert marked >= 0.08 * (plain + marked), f"off again, yet unmarked {plain:.0f}, marked {marked:.0f} Mbit/s"


@pytest.mark.timeout(120)
def test_per_node_delay_is_applied_or_refused_clearly(cluster_factory):
    c = cluster_factory(nodes=2, link=Link(rate_mbit=200), policy="exclusive")
    if not netem_available():
        with pytest.raises(Unsupported, match="netem"):
            c.shape(1, Link(rate_mbit=200, delay_ms=20))
        return
    # TCP connect to a closed port: SYN out, RST back, one round trip, no server needed.
    probe = ("import socket, sys, time; c = socket.socket(); c.settimeout(5); t = time.monotonic(); "
             "c.connect_ex((sys.argv[1], 1)); print(time.monotonic() - t)")
    base = float(c.exec(0, [sys.executable, "-c", probe, c.nodes[1].address], capture_output=True,
                        text=True).stdout)
    c.shape(1, Link(rate_mbit=200, delay_ms=20))
    slow = float(c.exec(0, [sys.executable, "-c", probe, c.nodes[1].address], capture_output=True,
                        text=True).stdout)
    # SYN to node1 and its RST back both cross node1's link: +2 x 20 ms.
    assert slow - base >= 0.035, f"RTT {base * 1000:.1f} ms -> {slow * 1000:.1f} ms with 20 ms on node1"


# ---- real jobs ------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_one_job_spans_both_nodes(cluster_factory, tmp_path):
    c = cluster_factory(nodes=2, link=Link(rate_mbit=400), policy="crossover")
    script = with_import(tmp_path)
    out = tmp_path / "solo"
    job = c.run([sys.executable, str(script), "--iters", "20", "--width", "256", "--out", str(out)], name="solo")
    assert job.wait(180) == 0, job.output()[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["digest"] for r in ranks}) == 1
    for i, node in enumerate(c.nodes):
        events = c.events(i)
        regs = [e for e in events if e.name == "register"]
        # rank i lives in node i's namespace and was scheduled by node i's daemon
        assert [(e.rank, e.node) for e in regs] == [(i, node.name)]
        assert sum(e.name == "grant" for e in events) >= 20


@pytest.mark.timeout(300)
def test_colocated_jobs_never_overlap_and_take_turns_in_the_same_order(cluster_factory, tmp_path):
    c = cluster_factory(nodes=2, link=Link(rate_mbit=400), policy="crossover")
    script = with_import(tmp_path)
    args = ["--iters", "60", "--width", "512", "--batch", "256"]
    jobs = [c.run([sys.executable, str(script), *args, "--out", str(tmp_path / name)], name=name)
            for name in ("alpha", "beta")]
    for j in jobs:
        assert j.wait(240) == 0, j.output()[-3000:]
    events = [c.events(i) for i in range(2)]
    for i, ev in enumerate(events):
        per_dev = compute_intervals(ev)
        assert list(per_dev) == [0], f"node{i} has one device"
        assert {job for _, _, job, _ in per_dev[0]}.__len__() == 2, f"node{i} did not serve both jobs"
        assert overlaps(per_dev[0]) == [], f"compute phases overlap on node{i}"
    # Turn order while both jobs run: the two daemons grant the same jobs in the same order.
    firsts = [min(e.t for ev in events for e in ev if e.name == "grant" and e.job == j)
              for j in {e.job for e in events[0] if e.name == "grant"}]
    lasts = [max(e.t for ev in events for e in ev if e.name == "grant" and e.job == j)
             for j in {e.job for e in events[0] if e.name == "grant"}]
    lo, hi = max(firsts), min(lasts)
    agree, n = _turn_agreement(events[0], events[1], lo, hi)
    assert n >= 30, f"too few alternations while both jobs ran ({n})"
    assert agree >= 0.9, f"node0 and node1 granted in different orders in {100 * (1 - agree):.0f}% of {n} turns"


@pytest.mark.timeout(240)
def test_a_device_model_serves_the_ranks_compute_and_shares_it_when_unscheduled(cluster_factory, tmp_path):
    from testbed.device_model import DeviceParams

    bench = WORKLOADS / "train_bench.py"
    c = cluster_factory(nodes=2, link=Link(rate_mbit=400), policy="passthrough",
                        device_model=DeviceParams(slice_us=1000, switch_us=100, interference=0.0))
    script = with_import(tmp_path, bench)
    args = ["--iters", "12", "--width", "128", "--batch", "100", "--device-ms-per-sample", "1.0"]
    jobs = [c.run([sys.executable, str(script), *args, "--out", str(tmp_path / name)], name=name)
            for name in ("alpha", "beta")]
    for j in jobs:
        assert j.wait(180) == 0, j.output()[-3000:]
    for name in ("alpha", "beta"):
        for path in sorted((tmp_path / name).glob("rank*.json")):
            its = json.loads(path.read_text())
            assert min(b - a for a, b in zip(its["iter_start"], its["iter_end"])) >= 0.099, path
    c.down()
    for n in c.state.nodes:  # type: ignore[union-attr]
        log = Path(n.log).with_suffix(".device.log").read_text()
        stats = json.loads(log.strip().splitlines()[-1])
        # 12 phases of 100 ms per job; two unscheduled jobs that start together share the
        # device (each at 1/2.2) part of the time, so the device is busy at least 2.4 s
        assert stats["phases"] == 24, log
        assert stats["busy_s"] >= 2.37 and stats["shared_s"] > 0.05, stats


# ---- teardown --------------------------------------------------------------------------------------------


def _pids_in(namespaces: list[str]) -> list[int]:
    pids = []
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids += [int(p) for p in out.split()]
    return pids


@pytest.mark.timeout(120)
def test_teardown_after_an_exception_inside_the_context(tmp_path):
    script = with_import(tmp_path)
    seen: dict[str, list] = {}
    with pytest.raises(RuntimeError, match="simulated failure"):
        with Cluster(ClusterSpec(nodes=2, link=Link(rate_mbit=200), policy="crossover"),
                     workdir=tmp_path / "c") as c:
            job = c.run([sys.executable, str(script), "--iters", "100000", "--out", str(tmp_path / "o")], name="long")
            deadline = time.monotonic() + 60
            while not any(e.name == "grant" for e in c.events(0)) and time.monotonic() < deadline:
                assert job.poll() is None, job.output()[-2000:]
                time.sleep(0.2)
            seen["ns"] = c.namespaces
            seen["pids"] = _pids_in(c.namespaces)
            assert len(seen["pids"]) >= 4  # two daemons, launcher, ranks
            raise RuntimeError("simulated failure")
    assert not set(seen["ns"]) & _netns()
    assert not [p for p in seen["pids"] if _alive(p)], "processes survived teardown"
    assert not any((Path("/etc/netns") / ns).exists() for ns in seen["ns"])


def _start_up(tmp_path: Path, name: str) -> tuple[subprocess.Popen, dict]:
    workdir = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cluster", "up", "--nodes", "2", "--rate", "100mbit",
                             "--policy", "exclusive", "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert " up in " in line, f"`up` printed {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc, json.loads((workdir / "cluster.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_up_tears_down_on_sigterm_and_ctrl_c(tmp_path, sig):
    proc, state = _start_up(tmp_path, sig.name)
    names = [state["hub_netns"], *(n["netns"] for n in state["nodes"])]
    assert set(names) <= _netns()
    pids = _pids_in(names)
    proc.send_signal(sig)
    assert proc.wait(30) == 0 or proc.returncode in (-sig, 128 + sig)
    assert not set(names) & _netns(), f"{sig.name}: namespaces left behind"
    assert not [p for p in pids if _alive(p)], f"{sig.name}: processes survived"


@pytest.mark.timeout(120)
def test_down_stale_cleans_up_after_a_sigkilled_owner(tmp_path):
    proc, state = _start_up(tmp_path, "killed")
    names = [state["hub_netns"], *(n["netns"] for n in state["nodes"])]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert set(names) <= _netns()  # nobody could clean up
    res = subprocess.run([sys.executable, "-m", "testbed.cluster", "down", "--stale"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not set(names) & _netns(), res.stdout


@pytest.mark.timeout(180)
def test_cli_run_builds_runs_and_removes_an_ephemeral_cluster(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cluster", "run", "--nodes", "2", "--rate", "300mbit",
                             "--policy", "exclusive", "--job-name", "cli", "--", sys.executable,
                             str(WORKLOADS / "train_mlp.py"), "--iters", "5", "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "o").glob("rank*.json")) == ["rank0.json", "rank1.json"]
    # Only this run's namespaces (named after its pid): other clusters may come and go meanwhile.
    left = {ns for ns in _netns() if ns.startswith(f"xo{proc.pid}c")}
    assert not left, f"left behind: {left}"


def test_bad_input_is_refused_with_a_clear_message():
    from testbed.cluster import ClusterError, parse_rate

    assert parse_rate("200mbit") == 200 and parse_rate("1gbit") == 1000 and parse_rate("0") is None
    with pytest.raises(ClusterError, match="not understood"):
        parse_rate("fast")
    with pytest.raises(ClusterError, match="jitter needs a delay"):
        Link(rate_mbit=10, jitter_ms=2)
    with pytest.raises(ClusterError, match="do not exist"):
        ClusterSpec(nodes=2, links={5: Link(rate_mbit=1)})
    res = subprocess.run([sys.executable, "-m", "testbed.cluster", "run", "--cluster", "no-such-cluster", "--",
                          "true"], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "no cluster 'no-such-cluster'" in res.stderr


_PORT_PROBE = """
import socket, sys, threading, time
def rate(port):
    srv = socket.create_server(("127.0.0.1", port))
    def sink():
        conn, _ = srv.accept()
        while conn.recv(1 << 20):
            pass
    reader = threading.Thread(target=sink)
    reader.start()
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    sock.sendall(b"x" * (4 << 20))
    sock.close()
    reader.join()
    srv.close()
    return 4 * 8 * 1.048576 / (time.perf_counter() - started)
print(rate(int(sys.argv[1])), rate(int(sys.argv[1]) + 1))
"""


def test_one_port_on_a_namespaces_loopback_is_shaped_and_every_other_is_not():
    # bench.group_async --service-link-mbit: the parameter service behind a thin link, the rest local
    from testbed.cluster.netns import ip
    from testbed.cluster.shaping import shape_port

    ns = f"xo-port-{os.getpid()}"
    ip("netns", "add", ns)
    try:
        shape_port(ns, 29611, 100)
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _PORT_PROBE, "29611"],
                              capture_output=True, text=True, timeout=60, check=True)
        shaped, free = map(float, done.stdout.split())
    finally:
        ip("netns", "del", ns, check=False)
    assert 60 < shaped < 130, shaped  # Mbit/s through a 100 Mbit/s class
    assert free > 5 * shaped, (shaped, free)
