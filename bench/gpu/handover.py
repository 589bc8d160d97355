"""How long a hand-over leaves the GPU idle: today's path through the daemon against two paths the GPU performs.

`bench.gpu --only handover` (under 90 s of GPU time). Two processes, each its own
CUDA context on one GPU, take turns; a turn is a kernel that stamps the GPU's
global timer, `--work-ms` of one-thread spin, and a second stamp. Every process
reads the same timer, so the gap from one turn's end to the next one's start is
measured on the GPU itself, whoever ran them:

  daemon   today's path: each process is a rank of its own job under a real
           crossoverd (policy exclusive): ask for a grant, launch the turn, wait
           for the device to finish it (a blocking CUDA event, as the plugin's
           release does), release. The gap splits into: drain (the GPU finished
           until the holder's CPU knows), release→grant (the holder's release
           until the next rank's grant returns: socket, daemon, wake-up), ramp
           (that grant until the next turn's first kernel runs: launch and
           context switch). CPU times are mapped onto the GPU timer by an offset
           each process measures (stamp, then read the host clock).
  slots    the hand-over on the GPU with stream memory operations: a page of a
           shared-memory file that the parent (standing in for the daemon) owns
           holds one 32-bit word per process; a turn starts with
           `cuStreamWaitValue32(other's word >= n)` and ends with
           `cuStreamWriteValue32(own word, n)`. Each process posts its next turn
           as soon as its own turn is done, then sleeps on it.
  ipc      interprocess CUDA events: the holder records its event after its
           turn and says so on a pipe; the next process waits on that event on
           its stream (`wait_event`) and launches.

and three checks beside the gaps:

  thrash   does a wait posted by another context slow the holder? The holder's
           turn length alone, then while the other process has a wait posted.
  kill     a holder SIGKILLed mid-turn while the next process has its wait posted
           on the holder's word: does the waiter run without help, and once the
           parent writes the word itself (the daemon's rescue store), how soon?
  kill_ipc the same with an interprocess event the dead holder never records.

`--dry-run` runs daemon, slots, thrash and kill on the CPU: the "device" is the
process's own core, stamps are the host clock and a wait polls the shared page. It
checks the plumbing (processes, the daemon, the shared page, the rescue store),
not the GPU: its figures are CPU figures.
"""
from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing as mp
import os
import signal
import statistics
import struct
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.lib.judge import percentile

__all__ = ["check_handover", "gaps"]

_PAGE = 4096
_WORDS = 4  # 0: A's turns done, 1: B's, 2: the thrash check's gate


# ---- the device each process drives -----------------------------------------------------------------


class _Gpu:
    """One CUDA context: its own stream, a stamp buffer, the shared page mapped into the device."""

    def __init__(self, page_path: str, stamps: int) -> None:
        import torch

        from bench.lib.cuda_driver import CudaDriver

        self.torch = torch
        torch.cuda.init()
        self.buf = torch.zeros(max(stamps, 64), dtype=torch.int64, device="cuda")
        self.stream = torch.cuda.Stream()
        self.h = self.stream.cuda_stream
        self.drv = CudaDriver()
        self._fd = os.open(page_path, os.O_RDWR)
        self.page = mmap.mmap(self._fd, _PAGE)
        import ctypes

        self._anchor = ctypes.c_char.from_buffer(self.page)
        self.page_dev = self.drv.register_host(ctypes.addressof(self._anchor), _PAGE)
        self._events: dict[bytes, Any] = {}
        self.ipc = torch.cuda.Event(interprocess=True)

    def stamp(self, i: int) -> None:
        self.drv.stamp(self.h, self.buf.data_ptr() + 8 * i)

    def spin(self, ns: int) -> None:
        self.drv.spin(self.h, ns)

    def wait_value(self, word: int, value: int) -> None:
        self.drv.wait_value(self.h, self.page_dev + 4 * word, value)

    def write_value(self, word: int, value: int) -> None:
        self.drv.write_value(self.h, self.page_dev + 4 * word, value)

    def sync(self) -> None:
        done = self.torch.cuda.Event(blocking=True)
        done.record(self.stream)
        done.synchronize()

    def done(self) -> bool:
        return bool(self.stream.query())

    def stamps(self, n: int) -> list[int]:
        self.sync()
        return [int(x) for x in self.buf[:n].cpu().tolist()]

    def clock_offset(self) -> tuple[float, float]:
        """GPU timer minus host monotonic clock (ns), and its uncertainty: the best of 30 stamp round trips."""
        best = (0.0, float("inf"))
        for _ in range(30):
            t0 = time.monotonic_ns()
            self.stamp(len(self.buf) - 1)
            self.sync()
            t1 = time.monotonic_ns()
            gpu = int(self.buf[len(self.buf) - 1].item())
            if t1 - t0 < best[1]:
                best = (gpu - (t0 + t1) / 2, (t1 - t0) / 2)
        return best

    def ipc_handle(self) -> bytes:
        return bytes(self.ipc.ipc_handle())

    def record(self) -> None:
        self.ipc.record(self.stream)

    def wait_ipc(self, handle: bytes) -> None:
        if handle not in self._events:
            self._events[handle] = self.torch.cuda.Event.from_ipc_handle(self.torch.cuda.current_device(), handle)
        self.stream.wait_event(self._events[handle])


class _CpuStandIn:
    """The dry run's device: a thread of the process runs its "stream" of work in order, as a GPU would.

    Work is queued and runs on that thread; a wait polls the shared page; `sync` waits for the queue."""

    def __init__(self, page_path: str, stamps: int) -> None:
        import queue
        import threading

        self._fd = os.open(page_path, os.O_RDWR)
        self.page = mmap.mmap(self._fd, _PAGE)
        self.buf = [0] * max(stamps, 64)
        self._q: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._stream, daemon=True).start()

    def _stream(self) -> None:
        while True:
            op = self._q.get()
            op()
            self._q.task_done()

    def stamp(self, i: int) -> None:
        self._q.put(lambda: self.buf.__setitem__(i, time.monotonic_ns()))

    def spin(self, ns: int) -> None:
        def run() -> None:
            end = time.monotonic_ns() + ns
            while time.monotonic_ns() < end:
                pass
        self._q.put(run)

    def wait_value(self, word: int, value: int) -> None:
        def run() -> None:
            while struct.unpack_from("<I", self.page, 4 * word)[0] < value:
                time.sleep(20e-6)
        self._q.put(run)

    def write_value(self, word: int, value: int) -> None:
        self._q.put(lambda: struct.pack_into("<I", self.page, 4 * word, value))

    def sync(self) -> None:
        self._q.join()

    def done(self) -> bool:
        return self._q.unfinished_tasks == 0

    def stamps(self, n: int) -> list[int]:
        self.sync()
        return self.buf[:n]

    def clock_offset(self) -> tuple[float, float]:
        return 0.0, 0.0


def _device(cfg: dict[str, Any]) -> _Gpu | _CpuStandIn:
    return (_CpuStandIn if cfg["dry_run"] else _Gpu)(cfg["page"], 4 * cfg["turns"] + 8)


# ---- the workers (each a fresh process) ----------------------------------------------------------------


def _turn(dev: _Gpu | _CpuStandIn, k: int, work_ns: int) -> None:
    dev.stamp(2 * k)
    dev.spin(work_ns)
    dev.stamp(2 * k + 1)


def _worker(kind: str, role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> None:
    """One process of a check; sends its figures (or its error) to the parent."""
    try:
        parent.send(_WORKERS[kind](role, cfg, parent, peer))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        parent.send({"error": f"{type(exc).__name__}: {exc}"})


def _run_daemon_path(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    from crossover.client.rank.session import Session
    from crossover.protos.identity import RankIdentity
    from crossover.settings import PluginSettings

    dev = _device(cfg)
    offset = dev.clock_offset()
    ident = RankIdentity(job_id=f"handover-{role}", job_name=f"handover-{'ab'[role]}", rank=0, local_rank=0,
                         world_size=1, local_size=1, device=0)
    sess = Session(ident, PluginSettings(target=f"unix://{cfg['socket']}", lease=False, grant_timeout_s=30.0)).start()
    deadline = time.monotonic() + 20
    while not sess.attached and time.monotonic() < deadline:
        time.sleep(0.01)
    if not sess.attached:
        raise RuntimeError("the session did not attach to crossoverd in 20 s")
    parent.send("ready")
    parent.recv()  # both attached: go
    cpu: dict[str, list[int]] = {"granted": [], "launched": [], "drained": [], "released": []}
    for k in range(cfg["turns"]):
        sess.acquire(k, comm_s=0.0 if k else None)
        cpu["granted"].append(time.monotonic_ns())
        _turn(dev, k, cfg["work_ns"])
        cpu["launched"].append(time.monotonic_ns())
        dev.sync()
        cpu["drained"].append(time.monotonic_ns())
        sess.release(k, 0.0, comm_begins=True)
        cpu["released"].append(time.monotonic_ns())
    stamps = dev.stamps(2 * cfg["turns"])
    sess.close()
    return {"stamps": stamps, "cpu": cpu, "offset_ns": offset[0], "offset_err_ns": offset[1]}


def _run_slots(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    dev = _device(cfg)
    parent.send("ready")
    parent.recv()
    own, other = role, 1 - role
    for k in range(cfg["turns"]):
        if role == 0 and k:
            dev.wait_value(other, k)
        elif role == 1:
            dev.wait_value(other, k + 1)
        _turn(dev, k, cfg["work_ns"])
        dev.write_value(own, k + 1)
        dev.sync()
    return {"stamps": dev.stamps(2 * cfg["turns"])}


def _run_ipc(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    assert peer is not None
    dev = _device(cfg)
    if not isinstance(dev, _Gpu):
        raise RuntimeError("interprocess events need CUDA")
    peer.send(dev.ipc_handle())
    handle = peer.recv()
    parent.send("ready")
    parent.recv()
    for k in range(cfg["turns"]):
        if role == 1 or k:
            peer.recv()  # the other process recorded its turn
            dev.wait_ipc(handle)
        _turn(dev, k, cfg["work_ns"])
        dev.record()
        peer.send(k)
        dev.sync()
    return {"stamps": dev.stamps(2 * cfg["turns"])}


def _run_thrash(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    dev = _device(cfg)
    if role == 1:  # the waiter: when told, one wait on the gate word and a stamp behind it
        parent.send("ready")
        parent.recv()
        dev.wait_value(2, 1)
        dev.stamp(0)
        parent.send("posted")
        parent.recv()
        dev.sync()
        return {}
    n = cfg["turns"]
    for k in range(n):
        _turn(dev, k, cfg["work_ns"])
        dev.sync()
    parent.send("alone done")
    parent.recv()  # the waiter has posted its wait
    for k in range(n, 2 * n):
        _turn(dev, k, cfg["work_ns"])
        dev.sync()
    return {"stamps": dev.stamps(4 * n)}


def _run_kill(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    dev = _device(cfg)
    if role == 0:  # the holder: a long turn, then its word; it is killed before the word is written
        dev.stamp(0)
        dev.spin(int(cfg["hold_s"] * 1e9))
        dev.write_value(0, 1)
        parent.send("launched")
        dev.sync()
        return {}
    offset = dev.clock_offset()
    dev.wait_value(0, 1)
    dev.stamp(0)
    dev.spin(cfg["work_ns"])
    parent.send("posted")
    while not dev.done():
        time.sleep(0.001)
    return {"stamps": dev.stamps(1), "offset_ns": offset[0]}


def _run_kill_ipc(role: int, cfg: dict[str, Any], parent: Connection, peer: Connection | None) -> dict[str, Any]:
    assert peer is not None
    dev = _device(cfg)
    if not isinstance(dev, _Gpu):
        raise RuntimeError("interprocess events need CUDA")
    if role == 0:
        peer.send(dev.ipc_handle())
        dev.spin(int(cfg["hold_s"] * 1e9))
        dev.record()
        peer.send("recorded")
        parent.send("launched")
        dev.sync()
        return {}
    handle = peer.recv()
    peer.recv()
    dev.wait_ipc(handle)
    dev.stamp(0)
    parent.send("posted")
    while not dev.done():
        time.sleep(0.001)
    return {"stamps": dev.stamps(1)}


_WORKERS = {"daemon": _run_daemon_path, "slots": _run_slots, "ipc": _run_ipc, "thrash": _run_thrash,
            "kill": _run_kill, "kill_ipc": _run_kill_ipc}


# ---- the parent ------------------------------------------------------------------------------------------


class _Pair:
    """Two worker processes of one check, with a pipe between them; killed on every exit path."""

    def __init__(self, kind: str, cfg: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        a_peer, b_peer = ctx.Pipe()
        self.conns: list[Connection] = []
        self.procs = []
        for role, peer in ((0, a_peer), (1, b_peer)):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(kind, role, cfg, theirs, peer), daemon=True,
                               name=f"handover-{kind}-{role}")
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)

    def recv(self, role: int, timeout: float) -> Any:
        if not self.conns[role].poll(timeout):
            raise TimeoutError(f"worker {role} said nothing in {timeout:.0f} s")
        msg = self.conns[role].recv()
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"worker {role}: {msg['error']}")
        return msg

    def kill(self, role: int) -> None:
        proc = self.procs[role]
        if proc.is_alive() and proc.pid:
            os.kill(proc.pid, signal.SIGKILL)

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        for role, proc in enumerate(self.procs):
            proc.join(2.0)
            if proc.is_alive():
                self.kill(role)
                proc.join(5.0)


def gaps(turns_a: list[tuple[int, int]], turns_b: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Every change of process on the GPU: (gap ns, index of the turn that ended, of the one that started).

    Turns are (start, end) on one clock; index i < len(turns_a) names A's turn i,
    len(turns_a) + j B's turn j. A gap is the next turn's start minus the ended turn's end
    (negative: they overlapped)."""
    turns = sorted([(s, e, i) for i, (s, e) in enumerate(turns_a)]
                   + [(s, e, len(turns_a) + j) for j, (s, e) in enumerate(turns_b)])
    out = []
    for (_, e0, i0), (s1, _, i1) in zip(turns, turns[1:]):
        if (i0 < len(turns_a)) != (i1 < len(turns_a)):
            out.append((s1 - e0, i0, i1))
    return out


def _turns(stamps: list[int]) -> list[tuple[int, int]]:
    return [(stamps[2 * k], stamps[2 * k + 1]) for k in range(len(stamps) // 2)]


def _stats_ms(xs: Sequence[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median_ms": round(statistics.median(xs) / 1e6, 4),
            "p99_ms": round(percentile(list(xs), 99) / 1e6, 4), "max_ms": round(max(xs) / 1e6, 4)}


def _skip_warmup(g: list[tuple[int, int, int]], n: int) -> list[tuple[int, int, int]]:
    return g[min(n, len(g) // 4):]


def _pair_run(kind: str, cfg: dict[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    with _Pair(kind, cfg) as pair:
        for role in (0, 1):
            pair.recv(role, timeout)
        for conn in pair.conns:
            conn.send("go")
        return pair.recv(0, timeout), pair.recv(1, timeout)


def _measure_daemon(cfg: dict[str, Any]) -> dict[str, Any]:
    a, b = _pair_run("daemon", cfg, 60)
    ta, tb = _turns(a["stamps"]), _turns(b["stamps"])
    g = _skip_warmup(gaps(ta, tb), 4)
    runs = (a, b)
    parts: dict[str, list[float]] = {"drain": [], "release_to_grant": [], "ramp": []}
    n = len(ta)
    for _, i0, i1 in g:
        p, k0 = (runs[0], i0) if i0 < n else (runs[1], i0 - n)
        q, k1 = (runs[0], i1) if i1 < n else (runs[1], i1 - n)
        end_gpu = p["stamps"][2 * k0 + 1]
        start_gpu = q["stamps"][2 * k1]
        parts["drain"].append(p["cpu"]["drained"][k0] + p["offset_ns"] - end_gpu)
        parts["release_to_grant"].append(q["cpu"]["granted"][k1] - p["cpu"]["drained"][k0])
        parts["ramp"].append(start_gpu - (q["cpu"]["granted"][k1] + q["offset_ns"]))
    return {"gap": _stats_ms([x[0] for x in g]), "parts": {k: _stats_ms(v) for k, v in parts.items()},
            "clock_offset_err_ms": round(max(a["offset_err_ns"], b["offset_err_ns"]) / 1e6, 4)}


def _measure_gpu_path(kind: str, cfg: dict[str, Any]) -> dict[str, Any]:
    a, b = _pair_run(kind, cfg, 60)
    g = _skip_warmup(gaps(_turns(a["stamps"]), _turns(b["stamps"])), 4)
    return {"gap": _stats_ms([x[0] for x in g]), "overlaps": sum(1 for x in g if x[0] < 0)}


def _measure_thrash(cfg: dict[str, Any], page: mmap.mmap) -> dict[str, Any]:
    n = cfg["turns"]
    with _Pair("thrash", cfg) as pair:
        pair.recv(1, 60)  # the waiter is up, its wait not yet posted
        pair.recv(0, 60)  # the holder's turns alone are done
        pair.conns[1].send("post")
        pair.recv(1, 60)  # the waiter posted its wait
        pair.conns[0].send("go")  # the holder's second half runs beside the posted wait
        a = pair.recv(0, 60)
        struct.pack_into("<I", page, 8, 1)  # let the waiter go
        pair.conns[1].send("go")
        pair.recv(1, 60)
    turns = _turns(a["stamps"])
    alone = [e - s for s, e in turns[n // 4:n]]
    beside = [e - s for s, e in turns[n + n // 4:2 * n]]
    ratio = statistics.median(beside) / statistics.median(alone) if alone and beside else None
    return {"turn_alone": _stats_ms(alone), "turn_beside_posted_wait": _stats_ms(beside),
            "slowdown": None if ratio is None else round(ratio, 4)}


def _measure_kill(kind: str, cfg: dict[str, Any], page: mmap.mmap, unaided_s: float) -> dict[str, Any]:
    """SIGKILL the holder mid-turn; see whether the waiter runs by itself, then after the parent's store."""
    with _Pair(kind, cfg) as pair:
        pair.recv(0, 60)  # the holder launched its long turn
        pair.recv(1, 60)  # the waiter posted its wait
        time.sleep(min(0.2, cfg["hold_s"] / 4))
        pair.kill(0)
        killed = time.monotonic_ns()
        pair.procs[0].join(5)
        out: dict[str, Any] = {"holder_exit": pair.procs[0].exitcode}
        if pair.conns[1].poll(unaided_s):
            b = pair.recv(1, 1)
            out.update(waiter="ran without help", after_kill_ms=_after(b, killed))
            return out
        out["waiter_unaided"] = f"still waiting {unaided_s:g} s after the kill"
        if kind == "kill_ipc":
            out["waiter"] = "stranded: nothing outside the dead process can complete its event"
            pair.kill(1)
            return out
        struct.pack_into("<I", page, 0, 1)  # the daemon's rescue store
        stored = time.monotonic_ns()
        if pair.conns[1].poll(10):
            b = pair.recv(1, 1)
            out.update(waiter="ran after the rescue store", after_store_ms=_after(b, stored))
        else:
            out["waiter"] = "still stranded 10 s after the rescue store"
            pair.kill(1)
        return out


def _after(b: dict[str, Any], host_ns: int) -> float | None:
    if not b.get("stamps"):
        return None
    return round((b["stamps"][0] - b.get("offset_ns", 0.0) - host_ns) / 1e6, 3)


def check_handover(args: argparse.Namespace, workdir: Path, daemon_cls: Any, device_args: list[str]) -> dict[str, Any]:
    """Every path and check above, side by side in one run; one dict for gpu.json."""
    workdir.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    fd, page_path = tempfile.mkstemp(prefix="xo-handover-", dir=shm if shm.is_dir() else workdir)
    os.ftruncate(fd, _PAGE)
    page = mmap.mmap(fd, _PAGE)
    cfg: dict[str, Any] = {"dry_run": args.dry_run, "page": page_path, "turns": args.handover_turns,
                           "work_ns": int(args.handover_work_ms * 1e6), "hold_s": 2.0 if not args.dry_run else 0.5}
    out: dict[str, Any] = {"work_ms": args.handover_work_ms, "turns": args.handover_turns,
                           "device": "CPU stand-in (dry run)" if args.dry_run else "GPU"}

    def reset() -> None:
        page[:_WORDS * 4] = bytes(_WORDS * 4)

    try:
        with daemon_cls(workdir, "--no-lease", "--policy", "exclusive", *device_args) as d:
            reset()
            out["daemon"] = _measure_daemon({**cfg, "socket": str(d.socket)})
        for kind in ("slots", "ipc"):
            if kind == "ipc" and args.dry_run:
                out[kind] = {"skipped": "interprocess events need CUDA"}
                continue
            reset()
            out[kind] = _guarded(lambda kind=kind: _measure_gpu_path(kind, cfg))
        reset()
        out["thrash"] = _guarded(lambda: _measure_thrash(cfg, page))
        reset()
        out["kill"] = _guarded(lambda: _measure_kill("kill", cfg, page, 1.0))
        if args.dry_run:
            out["kill_ipc"] = {"skipped": "interprocess events need CUDA"}
        else:
            reset()
            out["kill_ipc"] = _guarded(lambda: _measure_kill("kill_ipc", cfg, page, 3.0))
    finally:
        page.close()
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(page_path)
    return out


def _guarded(fn: Any) -> dict[str, Any]:
    """One path's figures, or what stopped it (a path the driver refuses must not hide the others)."""
    try:
        return fn()  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - reported in gpu.json beside the other paths
        return {"error": f"{type(exc).__name__}: {exc}"}


def table(result: dict[str, Any]) -> str:
    """The gaps side by side, for the log."""
    rows = [f"hand-over gap on the {result['device']}, turns of {result['work_ms']:g} ms "
            "(median / p99 ms, GPU timer):"]
    for path in ("daemon", "slots", "ipc"):
        r = result.get(path, {})
        gap = r.get("gap")
        rows.append(f"  {path:<7} " + (f"{gap['median_ms']:.3f} / {gap['p99_ms']:.3f} (n={gap['n']})"
                                       if gap and gap.get("n") else str(r.get("error") or r.get("skipped") or "-")))
    parts = result.get("daemon", {}).get("parts", {})
    if parts:
        rows.append("  daemon path's parts (median ms): " + ", ".join(
            f"{k} {v['median_ms']:.3f}" for k, v in parts.items() if v.get("n")))
    for k in ("thrash", "kill", "kill_ipc"):
        rows.append(f"  {k}: {result.get(k)}")
    return "\n".join(rows)
