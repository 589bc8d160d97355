"""Real processes for multi-process tests: a crossoverd, horovodrun jobs, event-log checks.

Every process starts in its own session so teardown can kill its whole group,
even when a test fails half way.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
CONFORMANCE_RESULTS = ROOT / "results" / "conformance.json"
# Horovod 0.28.1's own tests and examples, beside the checkout (CI has shared/ there); run from there, never copied.
PEER = ROOT.parent / "shared" / "peer" / "horovod-0.28.1"
WITH_CROSSOVER = ROOT / "tests" / "conformance" / "with_crossover.py"  # runs a script with the import added
# The two placements of a 2-rank job: crossoverd --cpu-devices per placement.
PLACEMENTS = {"rank-per-device": "2", "ranks-share-device": "1"}
BIN = Path(sys.executable).parent


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class DaemonProc:
    socket: Path
    event_log: Path
    log: Path
    args: list[str]
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> DaemonProc:
        cmd = [str(BIN / "crossoverd"), "--socket", str(self.socket), "--event-log", str(self.event_log), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"crossoverd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.socket.exists() and cli("queue", "--json", socket=self.socket, check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"crossoverd did not come up: {self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            self.proc.wait()
            raise

    def events(self) -> list[dict[str, Any]]:
        from crossover.daemon.event_log import read_jsonl

        return read_jsonl(self.event_log) if self.event_log.exists() else []


def cli(*args: str, socket: Path, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    res = subprocess.run([str(BIN / "crossover"), *args, "--socket", str(socket)], capture_output=True, text=True,
                         timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"crossover {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


def queue_state(socket: Path, timeout: float = 5.0) -> dict[str, Any]:
    """The daemon's queue as `crossover queue --json` prints it, fetched in-process (cheap enough to poll)."""
    import grpc
    from crossover.formatting import to_json
    from crossover.protos import crossover_v1_pb2 as pb
    from crossover.protos import crossover_v1_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        reply = pb_grpc.AdminStub(ch).GetQueue(pb.QueueRequest(protocol_version=1, device=-1), timeout=timeout)
    return to_json("queue", reply)


def with_import(tmp: Path, script: str = "train_mlp.py") -> Path:
    """The workload with `import crossover.auto` added as its first line, nothing else changed."""
    src = (WORKLOADS / script).read_text()
    out = tmp / f"xo_{script}"
    out.write_text("import crossover.auto\n" + src)
    return out


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    out: Path
    log: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise AssertionError(
                f"job {self.name} did not finish in {timeout}s; log tail:\n{self.output()[-3000:]}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def summaries(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("rank*.json"))]


def horovodrun(name: str, script: Path, tmp: Path, np: int = 2, args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, mpi: bool = False, out_flag: bool = True,
               cwd: Path | None = None) -> Job:
    """Start `horovodrun -np N` on localhost with Gloo (or MPI) running `script`.

    `--out OUT` comes before `args` for our workloads; `out_flag=False` leaves it off for scripts
    that do not take it (someone else's, run through a launcher given as `script`).
    """
    out = tmp / f"out_{name}"
    log = tmp / f"{name}.log"
    full_env = {**os.environ, "CROSSOVER_JOB_NAME": name, "PYTHONUNBUFFERED": "1", **(env or {})}
    if mpi:
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--mpi" if mpi else "--gloo"]
    if mpi:
        cmd += ["--mpi-args=--oversubscribe"]
    cmd += [sys.executable, str(script), *(["--out", str(out)] if out_flag else []), *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, cwd=cwd)
    return Job(name, proc, out, log)


def record_conformance(row: dict[str, Any]) -> None:
    """Append a conformance row to `results/conformance.json` (one per pair and placement; the newest wins)."""
    CONFORMANCE_RESULTS.parent.mkdir(exist_ok=True)
    rows = json.loads(CONFORMANCE_RESULTS.read_text()) if CONFORMANCE_RESULTS.exists() else []
    rows = [r for r in rows if (r["pair"], r["placement"]) != (row["pair"], row["placement"])] + [row]
    CONFORMANCE_RESULTS.write_text(json.dumps(rows, indent=1) + os.linesep)


def judge_colocated_run(label: str, policy: str, run: dict[str, Any], base: dict[str, Any],
                        row: dict[str, Any]) -> None:
    """A co-located pair under a blocking policy, against the same pair under `passthrough`.

    The daemon granted devices, no compute phases overlapped on a device, no holder was
    `overdue`, and the pair took at most 2x its unscheduled time. Adds the policy's wall
    time, ratio and yields to `row` (a `results/conformance.json` row).
    """
    events = run["events"]
    per_dev = compute_intervals(events)
    assert per_dev, f"{label}: the daemon granted nothing"
    for dev, intervals in per_dev.items():
        assert overlaps(intervals) == [], f"{label}: compute phases overlap on device {dev}"
    overdue = [e for e in events if e["event"] == "overdue"]
    assert overdue == [], f"{label}: a holder stalled while holding its device: {overdue[:3]}"
    ratio = run["wall_s"] / base["wall_s"]
    row[f"{policy}_s"] = round(run["wall_s"], 2)
    row[f"{policy}_ratio"] = round(ratio, 2)
    row[f"{policy}_yields"] = run["yields"]
    assert ratio <= 2.0, f"{label}: {run['wall_s']:.1f}s against {base['wall_s']:.1f}s unscheduled ({ratio:.2f}x)"


def compute_intervals(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per device, the [grant, release) intervals from the event log.

    An `overdue` holder's interval ends where the daemon gave its device to the next rank.
    """
    open_: dict[tuple[str, int], tuple[float, int]] = {}
    out: dict[int, list[tuple[float, float, str, int]]] = {}
    for e in events:
        key = (e.get("job"), e.get("rank"))
        if e["event"] == "grant":
            open_[key] = (e["t"], e["device"])
        elif e["event"] in ("release", "leave", "overdue") and key in open_:
            t0, dev = open_.pop(key)
            out.setdefault(dev, []).append((t0, e["t"], key[0], key[1]))
    return out


def overlaps(intervals: list[tuple[float, float, str, int]]) -> list[tuple]:
    s = sorted(intervals)
    return [(a, b) for a, b in zip(s, s[1:]) if b[0] < a[1]]


def grants_out_of_turn(events: list[dict[str, Any]]) -> list[str]:
    """Grants in the daemon's log that did not go to the smallest (turn, job id) waiting on the device.

    Only requests the policy has seen compete. While a lease is being revoked on a
    device, other ranks' requests are held back until every holder has said what it
    computes (LEASE_RELEASED, an expired lease, or the holder leaving), and the holder's
    own request, made while it computed under the lease, is granted at once: it records
    work already running, not a choice between waiting ranks.
    """
    pending: dict[tuple, tuple[int, str]] = {}
    held: dict[Any, dict[tuple, tuple[int, str]]] = {}
    revoking: dict[Any, set[tuple]] = {}
    wrong: list[str] = []
    for e in events:
        dev = e.get("device")
        who = (dev, e.get("job"), e.get("rank"))
        kind = e["event"]
        if kind == "lease_revoke":
            revoking.setdefault(dev, set()).add(who)
        elif kind in ("lease_released", "lease_expired") or (kind in ("leave", "suspend")
                                                            and who in revoking.get(dev, ())):
            holders = revoking.get(dev, set())
            holders.discard(who)
            if not holders:
                revoking.pop(dev, None)
                pending.update(held.pop(dev, {}))
        if kind == "request":
            if revoking.get(dev) and who not in revoking[dev]:
                held.setdefault(dev, {})[who] = (e["turn"], e["job"])
            else:
                pending[who] = (e["turn"], e["job"])
        elif kind == "grant":
            mine = pending.pop(who, None)
            rivals = [k for w, k in pending.items() if w[0] == dev]
            if mine is None:
                wrong.append(f"grant to {who} with no request the policy had seen")
            elif rivals and min(rivals) < mine:
                wrong.append(f"grant to {who} at {mine} while {sorted(rivals)} waited")
        elif kind in ("cancel", "leave", "suspend"):  # a resumed rank's request is logged again
            pending.pop(who, None)
            held.get(dev, {}).pop(who, None)
    return wrong
