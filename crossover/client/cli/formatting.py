"""Pure formatters for the CLI: the daemon's replies (`crossover.client.replies` records) → versioned JSON or tables.

Kept free of I/O so they are tested directly and reused by `--watch`. The JSON and the tables read the same
records, so they agree; neither sees a protobuf, so a renamed proto field cannot change what a script reads.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from rich.table import Table
from rich.text import Text

from crossover.client.replies import DeviceState, Isolation, JobList, QueueState, RankState, Reply
from crossover.figures import format_bytes

__all__ = ["JSON_VERSION", "to_json", "queue_tables", "jobs_table"]

JSON_VERSION = 2  # 2: a reply's enums are words (`"priority": "normal"`, `"phase": "compute"`), unset fields null

_PHASE_STYLE = {"compute": "bold green", "waiting": "yellow", "comm": "cyan", "other": "dim", "idle": "dim",
                "suspended": "bold red", "overdue": "bold red"}


def to_json(kind: str, reply: Reply) -> dict[str, Any]:
    """`{"version": 2, "kind": ..., <the record's fields>}`: every field, each under its record's name, so keys
    are stable; a figure not measured and a field left unset are null."""
    return {"version": JSON_VERSION, "kind": kind, **dataclasses.asdict(reply)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}" if seconds else "-"


def _isolation(iso: Isolation) -> str:
    """The device's isolation controller in one phrase: the protected job's pace alone and now, the lower
    classes' budget and what each lower job held (device seconds per second, last window)."""
    ref, cur = iso.reference_s, iso.current_s
    pace = f"alone {1000 * ref:.0f} ms" if ref else "measuring it alone"
    if ref and cur:
        pace += f", now {1000 * cur:.0f} ms" + (f" ({iso.kept:.2f}x, target {iso.target:g})" if iso.kept else "")
    got = ", ".join(f"{shown(job, 20).plain} {v:.2f}" for job, v in sorted(iso.lower_share.items()))
    return f"protect [{iso.window}] {pace}; lower budget {iso.budget:.2f} s/s" + (f" (held: {got})" if got else "")


def _bytes(n: int) -> str:
    """A size in a table: `-` for none."""
    return format_bytes(n) if n else "-"


def shown(value: Any, limit: int = 80) -> Text:
    """A string someone else chose (a job name, a device name), as plain text for the terminal.

    Never markup (a job named `[/bold]` is shown as written), never a control character
    (an ESC sequence in a name cannot clear the screen or retitle the window: shown as
    `\x1b`), and at most `limit` characters.
    """
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))
    return Text(text if len(text) <= limit else text[: limit - 1] + "…")


def _phase(rank: RankState) -> Text:
    return Text(rank.phase, style=_PHASE_STYLE.get(rank.phase, ""))


_QUEUE_COLUMNS = ("", "job", "user", "rank", "pid", "phase", "iter", "comp ms", "comm ms", "wait", "hand-over",
                  "cpu%", "rss", "gpu mem", "mem cap")
# What a narrow terminal loses, in order:
_DROP_FIRST = ("pid", "hand-over", "rss", "gpu mem", "cpu%", "user", "comm ms", "iter")
_RIGHT = {"rank", "pid", "iter", "comp ms", "comm ms", "wait", "cpu%", "rss", "gpu mem", "mem cap"}


_MIN_WIDTH = {"": 5, "job": 6, "phase": 7}  # "holds" and "#12", a job, a phase keep one width frame to frame


def _fit(columns: list[str], rows: list[dict[str, Text]], width: int | None) -> list[str]:
    """The columns that fit `width` (None: all), dropping the least needed first."""
    def need(cols: list[str]) -> int:  # a cell's text (or its column's least width), a space each side, rules
        return sum(max([len(c), _MIN_WIDTH.get(c, 0), *(len(r[c].plain) for r in rows)]) + 3 for c in cols) + 1

    kept = list(columns)
    for name in _DROP_FIRST:
        if width is None or need(kept) <= width:
            break
        if name in kept:
            kept.remove(name)
    return kept


def queue_tables(state: QueueState, width: int | None = None) -> list[Table]:
    """One table per device: holder first, then waiting ranks in grant order, then the rest.

    `hand-over` says how each rank ends its turns: on its device, or by its CPU waiting for the device.
    With a `width` (the terminal's), columns are dropped until the table fits: pid, hand-over, rss,
    gpu mem, cpu%, user, comm ms, iter, in that order (`crossover queue --wide` keeps them all).
    """
    return [_device_table(dev, width) for dev in state.devices]


def _device_title(dev: DeviceState) -> Text:
    """`device 0 (gpu H100)` and what else is true of it: draining, utilization, memory, order, sharing."""
    title = Text(f"device {dev.index} (") + shown(dev.kind) + " " + shown(dev.name) + ")"
    extras = []
    if dev.draining:
        refused = dev.refused_while_draining
        extras.append("DRAINING" + (f" ({refused} new rank{'s' * (refused != 1)} refused, unscheduled)"
                                    if refused else ""))
    if dev.utilization is not None:
        extras.append(f"util {dev.utilization:.0f}%")
    if dev.memory_total_bytes:
        extras.append(_device_memory(dev))
    if dev.order:
        extras.append("order " + " → ".join(shown(o, 40).plain for o in dev.order))
    if dev.sharing:
        extras.append(f"{dev.sharing} ({shown(dev.sharing_reason, 80).plain})")
    if dev.isolation is not None:
        extras.append(_isolation(dev.isolation))
    return title + Text("  " + "  ".join(extras)) if extras else title


def _device_table(dev: DeviceState, width: int | None) -> Table:
    marked = [("holds", r) for r in dev.holders]
    marked += [(f"#{i + 1}", r) for i, r in enumerate(dev.waiting)]
    marked += [("", r) for r in dev.others]
    gpu = any(r.gpu_memory_bytes for _, r in marked)
    capped = any(r.memory_cap_bytes is not None for _, r in marked)
    rows = []
    for mark, r in marked:
        job = r.job_name + (" (ddp)" if r.framework == "ddp" else "")
        rows.append({"": Text(mark), "job": shown(job), "user": shown(r.user or "-", 16),
                     "rank": Text(str(r.rank)), "pid": Text(str(r.pid)), "phase": _phase(r),
                     "iter": Text(str(r.iteration)), "comp ms": Text(_ms(r.mean_compute_s)),
                     "comm ms": Text(_ms(r.mean_comm_s)), "wait": Text(f"{100 * r.wait_fraction:.0f}%"),
                     "hand-over": Text(r.handover),
                     "cpu%": Text("-" if r.cpu_percent is None else f"{r.cpu_percent:.0f}"),
                     "rss": Text(_bytes(r.rss_bytes)), "gpu mem": Text(_bytes(r.gpu_memory_bytes)),
                     "mem cap": Text(_cap(r.memory_cap_bytes))})
    columns = _fit([c for c in _QUEUE_COLUMNS if (gpu or c != "gpu mem") and (capped or c != "mem cap")], rows, width)
    t = Table(title=_device_title(dev), title_justify="left", expand=False, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="right" if col in _RIGHT else "left", no_wrap=True, min_width=_MIN_WIDTH.get(col))
    for row in rows:
        t.add_row(*(row[c] for c in columns))
    if not rows:
        t.add_row("", Text("idle: no ranks", style="dim"), *[""] * (len(columns) - 2))
    return t


def _device_memory(dev: DeviceState) -> str:
    """`mem 61 GiB/80 GiB (19 GiB free; prod 50 GiB, batch 9 GiB)`: the device's memory and each job's there."""
    per_job: dict[str, int] = {}
    for r in dev.ranks:
        per_job[r.job_name] = per_job.get(r.job_name, 0) + r.gpu_memory_bytes
    jobs = ", ".join(f"{shown(job, 24).plain} {_bytes(n)}" for job, n in per_job.items() if n)
    free = dev.memory_free_bytes
    inner = "; ".join(part for part in (f"{_bytes(free)} free" if free else "", jobs) if part)
    return f"mem {_bytes(dev.memory_used_bytes)}/{_bytes(dev.memory_total_bytes)}" + (f" ({inner})" if inner else "")


def _cap(cap: int | None) -> str:
    """A memory cap: `-` for none, `0 B` for a cap of nothing."""
    if cap is None:
        return "-"
    return format_bytes(cap)


def _job_memory(ranks: Iterable[RankState]) -> str:
    """Each device's share of the job here: `d0 9.1 GiB (cap 16 GiB)`; `-` when nothing is known."""
    per_device: dict[int, tuple[int, int | None]] = {}
    for r in ranks:
        used, cap = per_device.get(r.device, (0, None))
        if r.memory_cap_bytes is not None:
            cap = (cap or 0) + r.memory_cap_bytes
        per_device[r.device] = (used + r.gpu_memory_bytes, cap)
    shown_ = [f"d{d} {_bytes(used)}" + ("" if cap is None else f" (cap {_cap(cap)})")
              for d, (used, cap) in sorted(per_device.items()) if used or cap is not None]
    return ", ".join(shown_) or "-"


def jobs_table(state: JobList) -> Table:
    t = Table(title="jobs on this node", title_justify="left")
    for col in ("job", "framework", "user", "id", "class", "world", "ranks here", "phases", "iter", "gpu mem",
                "registered s"):
        t.add_column(col)
    for job in state.jobs:
        phases = ", ".join(f"{r.rank}:{r.phase}" for r in job.ranks)
        iters = max((r.iteration for r in job.ranks), default=0)
        users = sorted({r.user for r in job.ranks if r.user})
        weight = job.weight or 1.0
        by = job.class_set_by
        klass = job.priority + ("" if weight == 1.0 else f" x{weight:g}") + (f" ({shown(by, 20)})" if by else "")
        t.add_row(shown(job.job_name), shown(job.framework or "-", 10), shown(",".join(users) or "-", 24),
                  shown(job.job_id[:12]), klass, str(job.world_size), str(len(job.ranks)), phases,
                  str(iters), _job_memory(job.ranks), f"{job.registered_s:.0f}")
    notes = [f"{job.job_name} rank {r.rank}: {r.memory_note}" for job in state.jobs for r in job.ranks if r.memory_note]
    if notes:
        t.caption = "\n".join(shown(n, 400).plain for n in notes)
        t.caption_justify = "left"
    if not state.jobs:
        t.add_row(Text("no jobs registered", style="dim"), "", "", "", "", "", "", "", "", "", "")
    return t
