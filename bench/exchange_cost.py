"""What one group_async exchange costs: a leader pushes an update and waits for the global model.

A real parameter service process (the one rank 0 starts) and a real leader (`ServiceLink`); the
figure is the whole call, median of the timed exchanges after three that map fresh pages. Two places:

* loopback (default): the service and the leader on this machine, over TCP with each codec and
  through shared memory, by model size; and TCP's own floor: the model's bytes there and back over a
  bare loopback socket, with nothing computed;
* ``--link-mbit R``: the service on one node of an emulated cluster and the leader on another,
  across a link shaped to R Mbit/s (network namespaces, veth and tc: needs root), over TCP with
  each codec. Shared memory is not offered: the two are on different nodes.

    python -m bench.exchange_cost [--sizes 1,10,25] [--out results/group_async_exchange_cost.json]
    python -m bench.exchange_cost --link-mbit 1000 --sizes 10 --out results/group_async_exchange_link_1g.json
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.results import write_json
from crossover.figures import percentile

SIZES_M = (1, 10, 25)
# (label, codec, shared memory): TCP with each codec, and a leader on the service's node
PATHS = (("tcp fp32", "fp32", False), ("tcp fp16", "fp16", False), ("tcp topk 1%", "topk", False),
         ("shared memory", "fp32", True))
WARMUP = 3
FLOOR = "bare tcp"  # the model's bytes there and back over a loopback socket, nothing else: TCP's own floor


def time_exchanges(address: tuple[str, int], token: str, group: int, kind: str, shared: bool, numel: int,
                   repeats: int) -> list[float] | None:
    """Seconds per exchange of one leader (the warm-ups left out); None where shared memory was asked
    for and the service is not on this node."""
    import torch

    from crossover.plugins.aggregation.group_async.codec import Codec
    from crossover.plugins.aggregation.group_async.link import ServiceLink

    link = ServiceLink(address, token, group=group, codec=Codec(kind, 0.01), shared_memory=shared)
    model = torch.zeros(numel)
    link.start(model)
    try:
        if shared and not link.local:
            return None
        times = []
        for _ in range(WARMUP + repeats):
            model.add_(0.001)
            started = time.perf_counter()
            if link.exchange(model, wait=True) is None:
                raise RuntimeError(f"the service at {address[0]}:{address[1]} did not answer")
            times.append(time.perf_counter() - started)
        return times[WARMUP:]
    finally:
        link.close()


def socket_floor(numel: int, repeats: int) -> list[float]:
    """Seconds to move the model's fp32 bytes over a bare loopback TCP connection and back, as an exchange's
    push and answer do, between kept buffers and with nothing computed: what TCP alone costs here."""
    import threading

    import numpy as np

    from crossover.plugins.aggregation.group_async.wire import fill

    nbytes = numel * 4
    listener = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(listener.getsockname())
    far, _ = listener.accept()
    listener.close()
    for sock in (near, far):
        sock.settimeout(60.0)
    buffers = [np.ones(nbytes, dtype=np.uint8) for _ in range(3)]
    views = [b.data for b in buffers]

    def echo() -> None:
        for _ in range(WARMUP + repeats):
            fill(far, views[1])
            far.sendall(views[1])

    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    times = []
    try:
        for _ in range(WARMUP + repeats):
            started = time.perf_counter()
            near.sendall(views[0])
            fill(near, views[2])
            times.append(time.perf_counter() - started)
    finally:
        peer.join(60)
        near.close()
        far.close()
    return times[WARMUP:]


def _row(numel: int, label: str, kind: str, shared: bool, times: list[float], where: str) -> dict[str, Any]:
    times = sorted(times)
    p50 = percentile(times, 50)
    return {"params": numel, "mb_fp32": numel * 4 / 1e6, "path": label, "codec": kind, "shared_memory": shared,
            "where": where, "exchange_ms_p50": 1e3 * p50, "exchange_ms_min": 1e3 * times[0],
            "exchange_ms_max": 1e3 * times[-1], "model_gb_per_s": numel * 4 / p50 / 1e9, "repeats": len(times)}


def _repeats(numel: int) -> int:
    return 4 if numel >= 10_000_000 else 12


def loopback(console: Console, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each path and size against a fresh service process on this machine."""
    from crossover.plugins.aggregation.group_async.service_process import ServiceProcess

    rows = []
    for numel in sizes:
        rows.append(_row(numel, FLOOR, "fp32", False, socket_floor(numel, _repeats(numel)), "loopback"))
        console.print(f"  {numel:>11,} params {FLOOR:>14}: {rows[-1]['exchange_ms_p50']:8.2f} ms")
        for group, (label, kind, shared) in enumerate(PATHS):
            service = ServiceProcess("127.0.0.1", 4)
            try:
                _, port = service.start()
                times = time_exchanges(("127.0.0.1", port), service.token, group, kind, shared, numel,
                                       _repeats(numel))
            finally:
                service.stop()
            if times is None:
                console.print(f"  {label}: not available here; skipped")
                continue
            rows.append(_row(numel, label, kind, shared, times, "loopback"))
            console.print(f"  {numel:>11,} params {label:>14}: {rows[-1]['exchange_ms_p50']:8.2f} ms")
    return rows


def over_link(console: Console, rate_mbit: float, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each TCP codec and size with the service on node 0 and the leader on node 1 of a two-node emulated
    cluster whose links are shaped to `rate_mbit`."""
    from crossover.plugins.aggregation.group_async.service_process import state_root
    from testbed.cluster import Cluster, ClusterSpec, Link

    rows = []
    where = f"link {rate_mbit:g} Mbit/s"
    with tempfile.TemporaryDirectory(prefix="crossover-exchange-") as tmp, \
            tempfile.TemporaryDirectory(prefix="crossover-exchange-", dir=state_root()) as state, \
            Cluster(ClusterSpec(nodes=2, link=Link(rate_mbit=rate_mbit)), workdir=Path(tmp) / "cluster") as cluster:
        token_file, port_file = Path(tmp) / "token", Path(tmp) / "port"
        token_file.write_text("exchange-cost")
        host = cluster.nodes[0].address
        for numel in sizes:
            for group, (label, kind, shared) in enumerate(PATHS):
                if shared:
                    continue
                port_file.unlink(missing_ok=True)
                service = subprocess.Popen(
                    ["ip", "netns", "exec", cluster.nodes[0].netns, sys.executable, "-m",
                     "crossover.plugins.aggregation.group_async.service", "--host", "0.0.0.0", "--bound", "4",
                     "--token-file", str(token_file), "--port-file", str(port_file), "--log-level", "WARNING",
                     "--state-dir", str(Path(state) / f"{numel}-{kind}")])
                try:
                    port = _wait_port(port_file, service)
                    done = cluster.exec(1, [sys.executable, "-m", "bench.exchange_cost", "--leader",
                                            f"{host}:{port}", "--token-file", str(token_file), "--codec", kind,
                                            "--params", str(numel), "--group", str(group)],
                                        capture_output=True, text=True, timeout=600, check=False)
                finally:
                    service.terminate()
                    service.wait(10)
                if done.returncode != 0:
                    raise RuntimeError(f"the leader on node 1 failed: {done.stderr.strip()[-2000:]}")
                rows.append(_row(numel, label, kind, False, json.loads(done.stdout), where))
                console.print(f"  {numel:>11,} params {label:>14} over {where}: "
                              f"{rows[-1]['exchange_ms_p50']:8.1f} ms")
    return rows


def _wait_port(port_file: Path, service: subprocess.Popen, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if service.poll() is not None:
            raise RuntimeError(f"the service exited with {service.returncode} before listening")
        time.sleep(0.05)
    raise RuntimeError(f"the service wrote no port in {timeout_s:g} s")


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="One exchange: push an update, receive the global model (median)")
    for column in ("params", "where", "path", "ms", "GB/s of model"):
        out.add_column(column)
    for r in rows:
        out.add_row(f"{r['params'] / 1e6:g} M", r["where"], r["path"], f"{r['exchange_ms_p50']:.1f}",
                    f"{r['model_gb_per_s']:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES_M)), help="model sizes, millions of parameters")
    p.add_argument("--link-mbit", type=float, default=0.0,
                   help="across a link of this many Mbit/s between two emulated nodes (root); 0: loopback")
    p.add_argument("--out", default="", help="write the rows here as JSON")
    p.add_argument("--leader", default="", help=argparse.SUPPRESS)  # HOST:PORT: run one leader, print its times
    p.add_argument("--token-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--codec", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.leader:
        host, port = args.leader.rsplit(":", 1)
        times = time_exchanges((host, int(port)), Path(args.token_file).read_text().strip(), args.group,
                               args.codec, False, args.params, _repeats(args.params))
        print(json.dumps(times))
        return
    console = Console()
    sizes = tuple(int(float(s) * 1_000_000) for s in args.sizes.split(","))
    rows = over_link(console, args.link_mbit, sizes) if args.link_mbit else loopback(console, sizes)
    console.print(table(rows))
    if args.out:
        write_json(Path(args.out), {"command": " ".join(["python -m bench.exchange_cost", *sys.argv[1:]]),
                                    "rows": rows})
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
