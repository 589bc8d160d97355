"""Prometheus metrics of one daemon (`crossoverd --metrics-address`).

Two sources, so that nothing is counted twice and nothing on the grant path
waits for a scrape:
- the event log: every entry the scheduler records passes `observe`, which
  counts grants, waits, phases, leases, suspensions, evictions, overdue holders
  and fail-opens (a rank that went ahead without its grant);
- the scheduler at scrape time (`_StateCollector`): who holds each device and
  how many wait, the policy and its decision counts, refused calls by status
  code, and the event log's own counts.

Per-job series are labelled by job name and id, and removed when the job's last
rank on this node leaves, so labels stay bounded by the jobs alive here.
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from crossover.daemon import rpc_errors
from crossover.daemon.limits import Connections
from crossover.daemon.scheduler import Scheduler
from crossover.protos.event_file import Event, EventName
from crossover.protos.event_records import CommEnd, Grant, JobClass, Leave, Release

__all__ = ["DaemonMetrics", "parse_address"]

_log = logging.getLogger(__name__)

_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_JOB = ("job_name", "job_id")


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:9464` for IPv6; `9464` or `:9464` mean loopback) -> (host, port)."""
    host, _sep, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


_PER_DEVICE = {EventName.DRAIN_REFUSED: "drain_refusals", EventName.PREEMPT: "preemptions",
               EventName.HANDOVER: "handovers", EventName.HANDOVER_RESCUE: "handover_rescues",
               EventName.LEASE: "leases", EventName.LEASE_REVOKE: "lease_revocations",
               EventName.SUSPEND: "suspensions", EventName.OVERDUE: "overdue"}
"""Events counted per device, each by the counter of that name."""


class DaemonMetrics:
    """The daemon's metrics in their own registry, fed by its event log (see the module doc)."""

    def __init__(self, core: Scheduler, version: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.grants = Counter("crossover_grants", "Compute grants given, by device and job.",
                              ("device", *_JOB), registry=r)
        self.grant_wait = Histogram("crossover_grant_wait_seconds", "Time from a rank's request to its grant.",
                                    ("device", *_JOB), buckets=_WAIT_BUCKETS, registry=r)
        self.compute = Histogram("crossover_compute_seconds", "Compute phases (grant to release), by job.",
                                 _JOB, buckets=_PHASE_BUCKETS, registry=r)
        self.comm = Histogram("crossover_comm_seconds", "Communication phases (allreduces), by job.",
                              _JOB, buckets=_PHASE_BUCKETS, registry=r)
        self.fail_opens = Counter("crossover_fail_opens", "Compute phases a rank ran without its grant (it stopped "
                                  "waiting: grant timeout, or a frozen daemon).", _JOB, registry=r)
        self.leases = Counter("crossover_leases", "Leases given to a rank whose job is alone on its device.",
                              ("device",), registry=r)
        self.lease_revocations = Counter("crossover_lease_revocations", "Leases taken back (another rank "
                                         "joined).", ("device",), registry=r)
        self.suspensions = Counter("crossover_suspensions", "Ranks suspended for missing heartbeats.",
                                   ("device",), registry=r)
        self.evictions = Counter("crossover_evictions", "Ranks removed by the daemon (silent, or process gone).",
                                 ("device",), registry=r)
        self.overdue = Counter("crossover_overdue_holders", "Holders treated as stalled (held far past their "
                               "compute time) so the next rank was served.", ("device",), registry=r)
        self.policy_switches = Counter("crossover_policy_switches", "Policy changes (SetPolicy).", registry=r)
        self.class_compute = Counter("crossover_class_compute_seconds", "Device time granted, by the priority class "
                                     "of the job that held it.", ("priority",), registry=r)
        self.preemptions = Counter("crossover_preemptions", "Lower-class holders asked to yield to a higher-class "
                                   "rank.", ("device",), registry=r)
        self.handovers = Counter("crossover_handover_ranks", "Ranks that began ending their turns on their device "
                                 "(no drain wait, no CPU in the hand-over).", ("device",), registry=r)
        self.handover_rescues = Counter("crossover_handover_rescues", "Turn tickets the daemon stored for a rank "
                                        "whose device could not (it died or stalled), so the next rank went on.",
                                        ("device",), registry=r)
        self._class_of: dict[str, str] = {}  # job id -> its class, as the event log last said
        self.drain_refusals = Counter("crossover_drain_refusals", "New ranks refused on a drained device (they "
                                      "train there unscheduled).", ("device",), registry=r)
        self.memory_cap_hits = Counter("crossover_memory_cap_hits", "Allocations a rank's allocator refused at "
                                       "its memory cap (crossoverd --reserve), by device and job.",
                                       ("device", *_JOB), registry=r)
        ProcessCollector(registry=r)
        self._state = _StateCollector(core, version)
        r.register(self._state)
        self._lock = threading.Lock()
        self._ranks: dict[str, int] = defaultdict(int)  # job id -> ranks registered here
        self._series: dict[str, set[tuple[Any, tuple[str, ...]]]] = defaultdict(set)  # job id -> its series
        self._server: Any = None
        core.events.add_listener(self.observe)

    def observe(self, entry: dict[str, Any]) -> None:
        """Count one event-log entry (an `EventLog` listener)."""
        ev = Event.from_json(entry)
        if ev is None:
            return
        name, device = ev.name, "" if ev.device is None else str(ev.device)
        if name is EventName.POLICY:
            self.policy_switches.inc()
        elif isinstance(name, EventName) and name in _PER_DEVICE:
            getattr(self, _PER_DEVICE[name]).labels(device).inc()
        elif ev.job is not None:
            self._observe_job(ev, (ev.job_name or "", str(ev.job)), device)

    def _observe_job(self, ev: Event, job: tuple[str, str], device: str) -> None:
        name = ev.name
        if name is EventName.GRANT:
            self._job(self.grants, job, device).inc()
            self._job(self.grant_wait, job, device).observe(Grant.of(ev).waited_s)
        elif name is EventName.RELEASE:
            held = Release.of(ev).held_s
            if held is not None:  # a release without a figure (suspended, gone) is no compute phase
                self._job(self.compute, job).observe(held)
                self.class_compute.labels(self._class_of.get(job[1], "normal")).inc(held)
        elif name is EventName.JOB_CLASS:
            self._class_of[job[1]] = JobClass.of(ev).priority
        elif name is EventName.COMM_END:
            self._job(self.comm, job).observe(CommEnd.of(ev).duration_s)
        elif name is EventName.CANCEL:
            self._job(self.fail_opens, job).inc()
        elif name is EventName.MEMORY_CAP_HIT:
            self._job(self.memory_cap_hits, job, device).inc()
        elif name is EventName.REGISTER:
            with self._lock:
                self._ranks[job[1]] += 1
        elif name is EventName.LEAVE:
            if Leave.of(ev).evicted:
                self.evictions.labels(device).inc()
            self._left(job[1])

    def _job(self, metric: Any, job: tuple[str, str], *first: str) -> Any:
        values = (*first, *job)
        with self._lock:
            self._series[job[1]].add((metric, values))
        return metric.labels(*values)

    def _left(self, job_id: str) -> None:
        with self._lock:
            self._ranks[job_id] -= 1
            if self._ranks[job_id] > 0:
                return
            del self._ranks[job_id]
            self._class_of.pop(job_id, None)
            series = self._series.pop(job_id, set())
        for metric, values in series:
            try:
                metric.remove(*values)
            except KeyError:
                pass

    def watch_connections(self, connections: Connections) -> None:
        """Export the daemon's open session streams (`Daemon.connections`), once it serves."""
        self._state.connections = connections

    def serve(self, address: str) -> tuple[str, int]:
        """Serve `/metrics` over HTTP on `address` (HOST:PORT; port 0 picks one); returns where."""
        host, port = parse_address(address)
        server, _thread = start_http_server(port, host, registry=self.registry)
        self._server = server
        bound = server.server_address
        _log.info("metrics on http://%s:%d/metrics", bound[0], bound[1])
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _StateCollector(Collector):
    """What the scheduler shows at the moment of a scrape (read under its lock, briefly)."""

    def __init__(self, core: Scheduler, version: str) -> None:
        self._core = core
        self._version = version
        self.connections: Connections | None = None

    def _memory(self, devices: dict[int, Any]) -> Iterator[Any]:
        """Each job's GPU memory per device (NVML's per process, summed per job), its cap there, and the
        device's free memory."""
        used = GaugeMetricFamily("crossover_job_gpu_memory_bytes", "GPU memory the job's processes hold on the "
                                 "device (NVML, summed per job).", labels=["device", *_JOB])
        cap = GaugeMetricFamily("crossover_job_memory_cap_bytes", "What the job may hold on the device "
                                "(crossoverd --reserve; no series: no cap).", labels=["device", *_JOB])
        free = GaugeMetricFamily("crossover_device_memory_free_bytes", "The device's free memory (NVML).",
                                 labels=["device"])
        for index, snap in sorted(devices.items()):
            dev = str(index)
            stats = self._core.inventory.stats(index)
            if stats.memory_total:
                free.add_metric([dev], stats.memory_free)
            held: dict[tuple[str, str], int] = defaultdict(int)
            capped: dict[tuple[str, str], int] = defaultdict(int)  # only the jobs with a cap here
            for r in (*snap.holders, *snap.waiting, *snap.others):
                job = (r.ident.job_name, r.ident.job_id)
                held[job] += stats.process_memory.get(r.ident.pid, 0)
                if r.memory_cap is not None:
                    capped[job] += r.memory_cap
            for job, n in held.items():
                if stats.memory_total:
                    used.add_metric([dev, *job], n)
            for job, limit in capped.items():
                cap.add_metric([dev, *job], limit)
        yield from (used, cap, free)

    def collect(self) -> Iterator[Any]:
        core = self._core
        devices, ranks = core.steering.snapshot()
        queue = GaugeMetricFamily("crossover_device_queue_length", "Ranks waiting for a grant on the device.",
                                  labels=["device"])
        busy = GaugeMetricFamily("crossover_device_busy", "1 while some rank holds the device.", labels=["device"])
        holder = GaugeMetricFamily("crossover_device_holder", "1 for the job holding the device (one series "
                                   "per holder).", labels=["device", *_JOB])
        on = GaugeMetricFamily("crossover_device_ranks", "Ranks registered on the device.", labels=["device"])
        draining = GaugeMetricFamily("crossover_device_draining", "1 while the device takes no new ranks.",
                                     labels=["device"])
        for index, snap in sorted(devices.items()):
            dev = str(index)
            queue.add_metric([dev], len(snap.waiting))
            busy.add_metric([dev], 1 if snap.holders else 0)
            on.add_metric([dev], len(snap.holders) + len(snap.waiting) + len(snap.others))
            draining.add_metric([dev], 1 if core.steering.is_draining(index) else 0)
            for job in {(r.ident.job_name, r.ident.job_id) for r in snap.holders}:
                holder.add_metric([dev, *job], 1)
        yield from (queue, busy, holder, on, draining)
        yield from self._memory(devices)
        kept = GaugeMetricFamily("crossover_protected_speed_ratio", "The protected (highest-class) job's speed "
                                 "beside the lower ones relative to alone, as the isolation controller last "
                                 "judged it: its latest shared windows pooled (crossoverd --protect).",
                                 labels=["device"])
        budget = GaugeMetricFamily("crossover_isolation_budget", "Device seconds per second the lower classes "
                                   "may hold now (0 in a solo window).", labels=["device"])
        for index in sorted(devices):
            view = core.steering.isolation(index)
            if view is not None:
                budget.add_metric([str(index)], view.budget)
                if view.kept is not None:
                    kept.add_metric([str(index)], view.kept)
        yield from (kept, budget)
        yield GaugeMetricFamily("crossover_jobs", "Jobs with a rank registered on this node.",
                                value=len({r.ident.job_id for r in ranks}))
        sessions = GaugeMetricFamily("crossover_sessions", "Registered ranks, by local user (the kernel's uid of "
                                     "the session socket peer; unknown on the gRPC stream).", labels=["uid"])
        for uid, n in sorted(core.steering.sessions_by_uid().items()):
            sessions.add_metric([uid], n)
        yield sessions
        if self.connections is not None:
            yield GaugeMetricFamily("crossover_session_streams", "Session streams open, both transports "
                                    "(crossoverd --max-connections).", value=self.connections.count)
            by_uid = GaugeMetricFamily("crossover_session_socket_streams", "Session socket streams open, by local "
                                       "user (crossoverd --max-connections-per-user).", labels=["uid"])
            for user, n in sorted(self.connections.by_uid().items()):
                by_uid.add_metric([str(user)], n)
            yield by_uid
        decisions = CounterMetricFamily("crossover_policy_decisions", "The current policy's notable decisions "
                                        "(overtake) since it was set.",
                                        labels=["policy", "decision"])
        policy = core.steering.policy_name
        for name, count in sorted(core.steering.policy_decisions().items()):
            decisions.add_metric([policy, name], count)
        yield decisions
        errors = CounterMetricFamily("crossover_rpc_errors", "Calls ended with an error, by gRPC status code.",
                                     labels=["code"])
        for code, count in sorted(rpc_errors.counts().items()):
            errors.add_metric([code], count)
        yield errors
        log = core.events
        yield CounterMetricFamily("crossover_event_log_entries", "Entries recorded in the event log.",
                                  value=log.recorded)
        yield CounterMetricFamily("crossover_event_log_dropped", "Entries a failed event-log file write lost "
                                  "(they stay in memory).", value=log.dropped)
        yield InfoMetricFamily("crossover_daemon", "The daemon: version, node, policy.",
                               value={"version": self._version, "node": core.node, "policy": policy})
        yield GaugeMetricFamily("crossover_uptime_seconds", "Seconds since the daemon started.",
                                value=core.steering.uptime())
