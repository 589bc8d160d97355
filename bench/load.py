"""Load: many client sessions against one real crossoverd, to see what the daemon costs and whether it holds up.

N sessions (each its own one-rank job, dealt round-robin over the daemon's
CPU devices; with two or more per device every device is contended and no
rank computes under a lease) loop like a
training rank for T seconds: acquire(iteration), sleep --compute-ms, release
with comm_begins, sleep --comm-ms (the allreduce), and fold that comm time into
the next acquire. The sessions run as threads in --procs worker processes, so
no one client interpreter's GIL paces the load. The daemon is a real
`crossoverd --policy exclusive` subprocess with an event log.

Grant round trip, net of queueing. Under load almost all of a rank's wait is
queueing behind the other ranks of its device; what the daemon adds is the
rest. `Session` does not expose the `Grant.waited_s` the daemon sends, so the
benchmark takes the same number from the daemon's event log instead: every
`grant` record carries `waited_s`, the time the request spent queued in the
daemon (from the moment the daemon read it to the grant decision). Each
client-measured acquire (wall time around `Session.acquire`) is matched to its
grant record by (job, iteration), and the net round trip is the difference:
the request's trip to the daemon, the daemon's handling, the grant's trip
back, and the client thread's wake-up (on a busy machine the wake-up is not
free, and it belongs to the cost a rank sees). Acquires answered at once under
a lease are left out.

Lost grants: (job, iteration) pairs where acquire() returned False while the
session was still attached (a grant timeout past --grant-timeout, and the
iterations of the cool-off after it), or where the event log shows a request
and never a grant. Acquires returning False while detached are
counted apart (the daemon dropped the rank).

Leak check. After every session is closed the benchmark waits (up to
--settle seconds) until the daemon has forgotten them (Admin.ListJobs) and its
thread count holds still, and compares that count with the idle daemon's. The
daemon's gRPC server runs unary calls (Register, Admin) on a thread pool that
grows with concurrent calls and keeps its threads up to its cap, so a few
threads more than idle are not a leak by themselves: --waves more waves of
the same sessions register and close, and a leak is suspected when the last
wave still left a thread for every fourth session or more (a pool at its cap
adds none; one thread leaked per session adds one per session every wave).

    python -m bench.load [--sessions 64] [--seconds 30] [--procs 8] [--compute-ms 5] [--comm-ms 20]
                         [--out results/load.json]

The figures are derived in `bench.load_analysis`.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.synchronize
import queue
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.lib.judge import mean, percentile
from bench.lib.results import machine, write_json
from bench.load_analysis import Key, grant_records, leak_suspected, lost_requests, net_of_queueing, split
from crossover.client.admin import AdminClient
from crossover.client.rank.session import Session
from crossover.protos.event_file import EventName, read_events
from crossover.protos.event_records import Leave
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings
from testbed.harness.daemon import DaemonProc

_log = logging.getLogger("bench.load")


@dataclass
class SessionResult:
    """What one session's driving thread saw; sent back from the worker process."""

    job: str
    attached: bool
    acquires: list[tuple[int, float, bool]] = field(default_factory=list)  # (iteration, wait s, leased)
    lost: list[int] = field(default_factory=list)  # iterations whose acquire returned False while attached
    detached: int = 0  # acquires returning False because the session was detached
    error: str = ""


# ---- worker processes ----------------------------------------------------


def _drive(tag: str, idx: int, args: argparse.Namespace, seconds: float, socket: str, start: Any,
           go: mp.synchronize.Event, grants: Any, out: list[SessionResult]) -> None:
    """One session: register, wait for the start, loop like a training rank until the deadline, close."""
    job = f"{tag}-{idx:04d}"
    info = RankIdentity(job_id=job, job_name=f"load{idx}", rank=0, local_rank=0, world_size=1, local_size=1,
                    device=idx % args.devices)
    settings = PluginSettings(target=f"unix://{socket}", job_name=info.job_name, device=info.device,
                              grant_timeout_s=args.grant_timeout, connect_timeout_s=30.0, reconnect_interval_s=1.0,
                              pin=False, lease=not args.no_lease)
    session = Session(info, settings)
    res = SessionResult(job=job, attached=False)
    out.append(res)
    try:
        session.start()
        res.attached = session.attached
        go.wait()
        deadline, it, comm_s = start.value + seconds, 0, None
        while time.monotonic() < deadline:
            leased = session.leased_acquires
            t0 = time.perf_counter()
            ok = session.acquire(it, comm_s)
            wait = time.perf_counter() - t0
            if ok:
                res.acquires.append((it, wait, session.leased_acquires != leased))
                with grants.get_lock():
                    grants.value += 1
            elif session.attached:
                res.lost.append(it)
            else:
                res.detached += 1
            t0 = time.perf_counter()
            time.sleep(args.compute_ms / 1000)
            session.release(it, time.perf_counter() - t0, comm_begins=True)  # the plugin releases either way
            t0 = time.perf_counter()
            time.sleep(args.comm_ms / 1000)
            comm_s = time.perf_counter() - t0
            it += 1
    except Exception as exc:  # report it, never hang the run
        res.error = repr(exc)
    finally:
        session.close()


def _worker(tag: str, indices: list[int], args: argparse.Namespace, seconds: float, socket: str, start: Any,
            go: mp.synchronize.Event, grants: Any, results: Any) -> None:
    """A worker process: one thread per session; hands back one list of SessionResult as dicts."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    out: list[SessionResult] = []
    threads = [threading.Thread(target=_drive, args=(tag, i, args, seconds, socket, start, go, grants, out),
                                daemon=True) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put([asdict(r) for r in out])


# ---- the daemon's side ---------------------------------------------------


class Watch:
    """Samples the daemon process (threads, RSS) from the main process."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak_threads = self.proc.num_threads()
        self.peak_rss = self.proc.memory_info().rss

    def sample(self) -> int:
        threads = self.proc.num_threads()
        self.peak_threads = max(self.peak_threads, threads)
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
        return threads

    def cpu_s(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def hwm_rss(self) -> int:
        """The kernel's peak RSS (VmHWM) when readable, else the sampled peak."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return max(self.peak_rss, int(line.split()[1]) * 1024)
        except OSError:
            pass
        return self.peak_rss


def registered_ranks(admin: AdminClient, prefix: str = "") -> int:
    """Ranks the daemon has registered now (of jobs whose id starts with ``prefix``)."""
    jobs = admin.jobs()
    return sum(len(j.ranks) for j in jobs.jobs if j.job_id.startswith(prefix))


# ---- the run -------------------------------------------------------------


def wave(ctx: Any, args: argparse.Namespace, tag: str, seconds: float, socket: str, admin: AdminClient,
         watch: Watch, procs: list[Any]) -> tuple[list[dict[str, Any]], float, float]:
    """Register ``args.sessions`` sessions, let them loop for ``seconds``, close them.

    Returns every session's result, the loop window's length and the daemon's CPU seconds in it.
    The worker processes are appended to ``procs`` so the caller can kill them whatever happens.
    """
    start, grants, go, results = ctx.Value("d", 0.0), ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    mine = [ctx.Process(target=_worker, args=(tag, part, args, seconds, socket, start, go, grants, results),
                        daemon=True) for part in split(args.sessions, args.procs)]
    procs += mine
    for p in mine:
        p.start()
    deadline = time.monotonic() + 60 + args.sessions
    while (n := registered_ranks(admin, f"{tag}-")) < args.sessions:
        if time.monotonic() > deadline or any(p.exitcode for p in mine):
            raise RuntimeError(f"only {n} of {args.sessions} sessions registered")
        watch.sample()
        time.sleep(0.2)
    cpu0 = watch.cpu_s()
    start.value = t0 = time.monotonic()
    go.set()
    if seconds:
        _log.info("%d sessions registered (daemon threads %d); running %.0f s", n, watch.sample(), seconds)
    collected: list[dict[str, Any]] = []
    next_report, cpu_s, run_end = t0 + args.progress, 0.0, None
    limit = t0 + seconds + args.grant_timeout + 60
    while len(collected) < args.sessions:
        try:
            collected += results.get(timeout=0.25)
        except queue.Empty:
            pass
        now, threads = time.monotonic(), watch.sample()
        if now >= next_report and run_end is None:
            _log.info("t=%4.0fs grants %7d (%.0f/s), daemon threads %d, CPU %.0f%%", now - t0, grants.value,
                      grants.value / (now - t0), threads, 100 * (watch.cpu_s() - cpu0) / (now - t0))
            next_report += args.progress
        if run_end is None and now >= t0 + seconds:
            run_end, cpu_s = now, watch.cpu_s() - cpu0  # the window the sessions ran in (closing excluded)
        if any(p.exitcode for p in mine) or now > limit:
            raise RuntimeError(f"workers did not finish; {len(collected)} of {args.sessions} sessions reported")
    for p in mine:
        p.join(10)
    return collected, (run_end or time.monotonic()) - t0, cpu_s


def settle(admin: AdminClient, watch: Watch, timeout: float) -> tuple[int, int]:
    """After a close: wait (bounded) until the daemon has dropped every rank and its thread count holds still
    for half a second; (ranks, threads) then."""
    end, last = time.monotonic() + timeout, -1
    while True:
        left, threads = registered_ranks(admin), watch.sample()
        if (not left and threads == last) or time.monotonic() > end:
            return left, threads
        last = threads
        time.sleep(0.5)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no fork of a process that holds a gRPC channel
    daemon = DaemonProc.in_dir(workdir, "--cpu-devices", str(args.devices), "--policy", "exclusive",
                               "--log-level", "WARNING", *(["--no-lease"] if args.no_lease else [])).start()
    procs: list[Any] = []
    admin = AdminClient(daemon.socket, timeout=10)  # start() returned once it answered
    try:
        watch = Watch(daemon.pid)
        threads_idle = watch.sample()
        collected, wall, cpu_s = wave(ctx, args, "load", args.seconds, str(daemon.socket), admin, watch, procs)
        left, threads_closed = settle(admin, watch, args.settle)
        rss_peak, threads_peak = watch.hwm_rss(), watch.peak_threads
        # The gRPC server's pool of threads for unary calls (Register, Admin) grows with concurrent calls
        # and keeps its threads, up to its cap: more waves of the same sessions tell that from a per-session leak.
        threads_waves, left_waves = [threads_closed], [left]
        for k in range(args.waves):
            _log.info("daemon threads after close %d (idle %d); register+close wave %d of %d",
                      threads_waves[-1], threads_idle, k + 1, args.waves)
            wave(ctx, args, f"again{k}", 0.0, str(daemon.socket), admin, watch, procs)
            n, threads = settle(admin, watch, args.settle)
            threads_waves.append(threads)
            left_waves.append(n)
    finally:
        admin.close()
        for p in procs:
            if p.is_alive():
                p.kill()
        daemon.stop()

    events = read_events(daemon.event_log, backups=100)  # every file crossoverd may have rotated it into
    requested, daemon_waits = grant_records(events)
    client: dict[Key, float] = {}
    refused: set[Key] = set()
    leased = detached = 0
    errors = [r["error"] for r in collected if r["error"]]
    for r in collected:
        for it, wait, was_leased in r["acquires"]:
            if was_leased:
                leased += 1
            else:
                client[(r["job"], it)] = wait
        refused |= {(r["job"], it) for it in r["lost"]}
        detached += r["detached"]
    net, unmatched = net_of_queueing(client, daemon_waits)
    raw = list(client.values())
    lost = lost_requests(requested, set(daemon_waits), refused)
    log_lines = daemon.log.read_text(errors="replace").splitlines() if daemon.log.exists() else []
    levels = Counter(w for line in log_lines for w in line.split()[:4] if w in ("WARNING", "ERROR", "CRITICAL"))
    kinds = Counter(str(e.name) for e in events)
    kinds.update(f"leave ({Leave.of(e).reason})" for e in events if e.name is EventName.LEAVE)
    return {
        "sessions": args.sessions, "seconds": round(wall, 2), "procs": len(split(args.sessions, args.procs)),
        "devices": args.devices,
        "compute_ms": args.compute_ms, "comm_ms": args.comm_ms,
        "sessions_attached": sum(r["attached"] for r in collected),
        "grants": sum(len(r["acquires"]) for r in collected), "daemon_grants": len(daemon_waits),
        "grants_per_s": sum(len(r["acquires"]) for r in collected) / wall, "leased_acquires": leased,
        "rtt_net_p50_ms": 1000 * percentile(net, 50), "rtt_net_p99_ms": 1000 * percentile(net, 99),
        "rtt_net_mean_ms": 1000 * mean(net), "rtt_matched": len(net), "rtt_unmatched": unmatched,
        "wait_p50_ms": 1000 * percentile(raw, 50), "wait_p99_ms": 1000 * percentile(raw, 99),
        "lost_grants": len(lost), "acquire_false_detached": detached,
        "daemon_cpu_s": cpu_s, "daemon_cpu_pct": 100 * cpu_s / wall, "daemon_peak_rss_mb": rss_peak / 2**20,
        "daemon_threads_idle": threads_idle, "daemon_threads_peak": threads_peak,
        "daemon_threads_after_close": threads_closed, "daemon_threads_after_each_wave": threads_waves,
        "daemon_thread_leak_suspected": leak_suspected(threads_waves, args.sessions),
        "ranks_registered_after_close": left, "ranks_registered_after_each_wave": left_waves,
        "events": {k: n for k, n in kinds.items() if k in ("suspend", "overdue", "lease_expired", "cancel")
                   or str(k).startswith("leave (")},
        "daemon_log": dict(levels), "session_errors": errors[:10],
    }


def print_table(s: dict[str, Any]) -> None:
    rows = [
        ("sessions (attached)", f"{s['sessions']} ({s['sessions_attached']})"),
        ("seconds", f"{s['seconds']:.1f}"),
        ("grants total (daemon log)", f"{s['grants']} ({s['daemon_grants']}), {s['grants_per_s']:.0f}/s"),
        ("grant RTT net of queueing p50 / p99", f"{s['rtt_net_p50_ms']:.3f} / {s['rtt_net_p99_ms']:.3f} ms "
                                                f"({s['rtt_matched']} matched, {s['rtt_unmatched']} unmatched)"),
        ("acquire wait incl. queueing p50 / p99", f"{s['wait_p50_ms']:.2f} / {s['wait_p99_ms']:.2f} ms"),
        ("lost grants (false while detached)", f"{s['lost_grants']} ({s['acquire_false_detached']})"),
        ("daemon CPU", f"{s['daemon_cpu_s']:.2f} s = {s['daemon_cpu_pct']:.1f}%"),
        ("daemon peak RSS", f"{s['daemon_peak_rss_mb']:.1f} MiB"),
        ("daemon threads idle / peak / after close",
         f"{s['daemon_threads_idle']} / {s['daemon_threads_peak']} / {s['daemon_threads_after_close']}"),
        ("... after each register+close wave", " ".join(map(str, s["daemon_threads_after_each_wave"]))
         + f" (leak suspected: {'yes' if s['daemon_thread_leak_suspected'] else 'no'})"),
        ("ranks registered after each close", " ".join(map(str, s["ranks_registered_after_each_wave"]))),
        ("daemon events of note", ", ".join(f"{k} {v}" for k, v in s["events"].items()) or "-"),
        ("daemon log warnings/errors", ", ".join(f"{k} {v}" for k, v in s["daemon_log"].items()) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"crossoverd load: {s['sessions']} sessions on {s['devices']} CPU devices, {s['procs']} client processes, "
          f"compute {s['compute_ms']} ms / comm {s['comm_ms']} ms")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=64, help="client sessions (one-rank jobs), default 64")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the sessions loop, default 30")
    p.add_argument("--procs", type=int, default=0,
                   help="client worker processes the sessions are spread over; 0 (default): min(8, sessions)")
    p.add_argument("--devices", type=int, default=2, help="crossoverd --cpu-devices; sessions go round-robin")
    p.add_argument("--compute-ms", type=float, default=5.0, help="the sleep between acquire and release")
    p.add_argument("--comm-ms", type=float, default=20.0, help="the sleep between release and the next acquire")
    p.add_argument("--grant-timeout", type=float, default=10.0,
                   help="a session's grant timeout (CROSSOVER_GRANT_TIMEOUT); an acquire past it is a lost grant")
    p.add_argument("--no-lease", action="store_true",
                   help="crossoverd --no-lease: a rank alone on its device pays the round trip too")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds after close to wait for the daemon to drop the ranks and their threads")
    p.add_argument("--waves", type=int, default=2,
                   help="after the measured run, register and close the same sessions this many more times "
                        "(the thread leak check)")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--out", type=Path, default=Path("results/load.json"), help="JSON results file")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args()
    if args.sessions < 1 or args.seconds <= 0 or args.devices < 1:
        p.error("--sessions and --devices must be >= 1, --seconds > 0")
    args.procs = args.procs or min(8, args.sessions)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemon and the workers are stopped

    with tempfile.TemporaryDirectory(prefix="xo-load-") as tmp:
        summary = run(args, Path(tmp))
    print_table(summary)
    write_json(args.out, {"benchmark": "load", "time": time.time(), "machine": machine(),
                          "args": {**vars(args), "out": str(args.out)}, "summary": summary})
    _log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
