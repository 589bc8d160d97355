"""What the conformance tier shares: Horovod's own suite beside the checkout, the placements a
2-rank job is run in, the policy rounds a co-located pair runs through, and how a run is judged and recorded."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from crossover.protos.event_file import Event
from crossover.protos.event_records import Policy, Release
from testbed.harness.daemon import DaemonProc, cli, set_policy
from testbed.harness.jobs import CHECKOUT, Job
from testbed.harness.oracles import compute_intervals, overlaps

# The wall times of the last run, outside the checkout (no test writes there); CROSSOVER_CONFORMANCE_OUT moves them.
CONFORMANCE_RESULTS = Path(os.environ.get("CROSSOVER_CONFORMANCE_OUT", "")
                           or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "crossover"
                           / "conformance.json")
# Horovod 0.28.1's own tests and examples, beside the checkout (CI has shared/ there); run from there, never copied.
PEER = CHECKOUT.parent / "shared" / "peer" / "horovod-0.28.1"
WITH_CROSSOVER = CHECKOUT / "tests" / "conformance" / "with_crossover.py"  # runs a script with the import added
# The two placements of a 2-rank job: crossoverd --cpu-devices per placement.
PLACEMENTS = {"rank-per-device": "2", "ranks-share-device": "1"}


# How much longer than unscheduled a co-located pair may take under a blocking policy, per placement.
# With a rank per device (one core each) a blocking policy only orders what shares a core anyway. With
# both ranks of a job on one device (both cores), it runs one rank at a time where unscheduled runs
# two: up to 2x is that placement's own cost, and the ImageNet pair (ResNet-50, a metric allreduce per
# sub-batch) measured 2.07-3.03x there in five runs, which 2x alone does not explain (an open question,
# not a pass mark): its limit is 4x, still far below what a stalled grant or a lost release costs.
RATIO_LIMIT = {"rank-per-device": 2.0, "ranks-share-device": 4.0}

# A co-located pair runs its script once per round in the same rank processes (`with_crossover.py
# --rounds`): optionally a warm-up, unjudged (what a short script's first run alone pays: lazy imports,
# data, Gloo's connections, Horovod's caches), then the unscheduled baseline, then side by side the
# blocking policies.
WARM_UP = "warm-up"
POLICY_ROUNDS = ("passthrough", "exclusive", "crossover")
# A pair may run one blocking round instead of two, the daemon switched between the blocking policies
# every `switch_every_s` while it runs (every second for the ImageNet example's 8-22 s rounds, a
# quarter second for the script pairs' 1.5-4 s ones); the event log, cut at each switch, still tells
# what each policy did.
ALTERNATING = "alternating"
ALTERNATING_ROUNDS = ("passthrough", ALTERNATING)


def _rounds(warm_up: bool, blocking: tuple[str, ...]) -> tuple[str, ...]:
    return ((WARM_UP,) if warm_up else ()) + blocking


def run_pair_in_rounds(daemon_factory: Callable[..., DaemonProc], jobs: list[Job], tmp: Path, devices: str,
                       label: str, start_job: Callable[[str, tuple[str, ...], dict[str, str]], Job],
                       warm_up: bool = True, blocking: tuple[str, ...] = POLICY_ROUNDS,
                       switch_every_s: float = 1.0) -> tuple[dict[str, float], list[Event]]:
    """Two co-located 2-rank jobs, A and B, through their rounds on a daemon of `devices` CPU devices.

    `start_job(name, flags, env)` starts job NAME through `with_crossover.py` with `flags` (the round
    flags) first and `env` (the daemon's socket and grant timeout) added. `blocking`: `POLICY_ROUNDS`,
    or `ALTERNATING_ROUNDS` (the policy switched every `switch_every_s`). Returns each round's wall
    time by round name and the daemon's event log.
    """
    d = daemon_factory("--cpu-devices", devices, "--policy", POLICY_ROUNDS[0], name="rounds")
    folder = tmp / "rounds"
    folder.mkdir()
    rounds = _rounds(warm_up, blocking)
    flags = ("--rounds", str(len(rounds)), "--round-dir", str(folder))
    env = {"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_GRANT_TIMEOUT": "60"}
    mine = []
    for name in ("A", "B"):
        jobs.append(start_job(name, flags, env))  # the caller's list: its teardown kills what is left
        mine.append(jobs[-1])
    walls = _drive_rounds(d, mine, folder, ranks=2, label=label, rounds=rounds, switch_every_s=switch_every_s)
    d.stop()
    return walls, d.events()


def _await_ranks(folder: Path, prefix: str, ranks: int, jobs: list[Job], label: str, timeout: float) -> None:
    """Until every rank of every job has written `folder/PREFIX-JOB-RANK` (`ranks` per job)."""
    deadline = time.monotonic() + timeout

    def arrived(job: Job) -> bool:
        return len(list(folder.glob(f"{prefix}{job.name}-*"))) >= ranks

    while True:
        behind = [j for j in jobs if not arrived(j)]
        if not behind:
            return
        for job in behind:
            if job.proc.poll() is not None and not arrived(job):
                raise AssertionError(f"{label}: job {job.name} exited {job.proc.returncode} before its ranks "
                                     f"reached {prefix.rstrip('-')}:\n{job.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{label}: not every rank reached {prefix.rstrip('-')} in {timeout:.0f}s:\n"
                                 + "\n".join(f"--- {j.name}\n{j.output()[-1500:]}" for j in jobs))
        time.sleep(0.05)


def _drive_rounds(daemon: DaemonProc, jobs: list[Job], folder: Path, ranks: int, label: str,
                  rounds: tuple[str, ...], switch_every_s: float = 1.0, timeout: float = 240) -> dict[str, float]:
    """Take co-located jobs (started with the round flags, the daemon under `passthrough`) through
    `rounds`; each round's wall time, from its start to its last rank's end, by round name.

    `ranks` is each job's. Before each round every rank waits, its device free, until all have arrived;
    the daemon is then switched to the round's policy by the operator's call, `crossover policy`, and
    the round starts for all at once. An `alternating` round starts under the first of `ALTERNATE` and
    switches every `switch_every_s`.
    """
    walls: dict[str, float] = {}
    policy = POLICY_ROUNDS[0]
    for k, name in enumerate(rounds):
        _await_ranks(folder, f"ready-{k}-", ranks, jobs, label, timeout)
        wanted = ALTERNATE[0] if name == ALTERNATING else name
        if name != WARM_UP and wanted != policy:
            cli("policy", wanted, socket=daemon.socket)
            policy = wanted
        alternating = (alternating_policies(daemon.socket, f"{label}, {name} round", every_s=switch_every_s)
                       if name == ALTERNATING else contextlib.nullcontext([]))
        with alternating:
            started = time.monotonic()
            (folder / f"go-{k}").touch()
            _await_ranks(folder, f"done-{k}-", ranks, jobs, label, timeout)
            walls[name] = time.monotonic() - started
        if name == ALTERNATING:
            policy = ""  # whichever the last switch left
    for job in jobs:
        rc = job.wait(30)
        assert rc == 0, f"{label}: job {job.name} exited {rc}:\n{job.output()[-3000:]}"
    return walls


def events_by_policy(events: list[Event], first: str = POLICY_ROUNDS[0]) -> dict[str, list[Event]]:
    """The event log cut at each policy switch: what happened under each policy, the daemon started
    under `first`. (Between rounds every rank waits, its device free, so no grant spans a cut.)"""
    out: dict[str, list[Event]] = {name: [] for name in POLICY_ROUNDS}
    current = first
    for e in events:
        if e.name is Policy.name:
            current = Policy.of(e).new
        else:
            out.setdefault(current, []).append(e)
    return out


def _under(events: list[Event], policies: tuple[str, ...],
           first: str = POLICY_ROUNDS[0]) -> list[Event]:
    """The events logged while the daemon ran one of `policies`, in their order."""
    out, current = [], first
    for e in events:
        if e.name is Policy.name:
            current = Policy.of(e).new
        elif current in policies:
            out.append(e)
    return out


def judge_rounds(label: str, placement: str, walls: dict[str, float], events: list[Event],
                 row: dict[str, Any]) -> None:
    """Every blocking round of a co-located pair, against its unscheduled round.

    Under each blocking policy the daemon granted devices, no compute phases overlapped on a device,
    no holder was `overdue`, and the round took at most the placement's `RATIO_LIMIT` times the
    `passthrough` round (an `alternating` round: both policies' shares of it, together). Adds each
    round's wall time, and each policy's ratio and yields, to `row` (a `CONFORMANCE_RESULTS` row).
    """
    cut = events_by_policy(events)
    blocking = _under(events, POLICY_ROUNDS[1:])  # also a phase that spans a switch between them
    for dev, intervals in compute_intervals(blocking).items():
        assert overlaps(intervals) == [], f"{label}: compute phases overlap on device {dev}"
    if WARM_UP in walls:
        row["warm_up_s"] = round(walls[WARM_UP], 2)
    base_s = walls["passthrough"]
    row["passthrough_s"] = round(base_s, 2)
    if ALTERNATING in walls:
        limit = RATIO_LIMIT[placement]
        wall_s = walls[ALTERNATING]
        row[f"{ALTERNATING}_s"], row[f"{ALTERNATING}_ratio"] = round(wall_s, 2), round(wall_s / base_s, 2)
        assert wall_s / base_s <= limit, (f"{label} alternating {', '.join(ALTERNATE)}: {wall_s:.1f}s against "
                                          f"{base_s:.1f}s unscheduled ({wall_s / base_s:.2f}x, limit {limit}x)")
    for policy in POLICY_ROUNDS[1:]:
        what, mine = f"{label} under {policy}", cut[policy]
        # (no overlap check on one policy's cut alone: a phase that spans switches would be misread there)
        assert any(e.name == "grant" for e in mine), f"{what}: the daemon granted nothing"
        overdue = [e for e in mine if e.name == "overdue"]
        assert overdue == [], f"{what}: a holder stalled while holding its device: {overdue[:3]}"
        row[f"{policy}_yields"] = sum(1 for e in mine if e.name is Release.name and Release.of(e).yields)
        if policy in walls:
            wall_s = walls[policy]
            ratio, limit = wall_s / base_s, RATIO_LIMIT[placement]
            row[f"{policy}_s"] = round(wall_s, 2)
            row[f"{policy}_ratio"] = round(ratio, 2)
            assert ratio <= limit, (f"{what}: {wall_s:.1f}s against {base_s:.1f}s unscheduled "
                                    f"({ratio:.2f}x, limit {limit}x)")


# One run of a long job serves both blocking policies: the daemon is switched between them every
# two seconds, as an operator's `crossover policy` does, so every switch lands on a live job.
ALTERNATE = ("exclusive", "crossover")
_SWITCH_EVERY_S = 2.0


@contextlib.contextmanager
def alternating_policies(socket: Path, label: str, every_s: float = _SWITCH_EVERY_S) -> Iterator[list[str]]:
    """Switch the daemon on `socket` between ALTERNATE's policies (it starts under the first) every
    `every_s` seconds while the block runs; yields the switches made, and fails after it if one failed
    or fewer than four were made."""
    stop, switches = threading.Event(), []

    def switch() -> None:
        k = 0
        while not stop.wait(every_s):
            k += 1
            try:
                set_policy(socket, ALTERNATE[k % 2])
            except Exception as exc:  # the daemon gone: the caller's own checks say why
                switches.append(f"failed: {exc}")
                return
            switches.append(ALTERNATE[k % 2])

    switcher = threading.Thread(target=switch, daemon=True)
    switcher.start()
    try:
        yield switches
    finally:
        stop.set()
        switcher.join(10)
    assert not [s for s in switches if s.startswith("failed")], f"{label}: a policy switch failed: {switches}"
    assert len(switches) >= 4, f"{label}: the job outran the policy switches ({switches})"


def record_conformance(row: dict[str, Any]) -> None:
    """Append a conformance row to `CONFORMANCE_RESULTS` (one per pair and placement; the newest wins)."""
    CONFORMANCE_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(CONFORMANCE_RESULTS.read_text()) if CONFORMANCE_RESULTS.exists() else []
    rows = [r for r in rows if (r["pair"], r["placement"]) != (row["pair"], row["placement"])] + [row]
    CONFORMANCE_RESULTS.write_text(json.dumps(rows, indent=1) + os.linesep)

