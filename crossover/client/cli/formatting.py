"""Pure formatters for the CLI: protobuf replies → versioned JSON dicts → rich tables.

Kept free of I/O so they are tested directly and reused by `--watch`.
"""
from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from rich.table import Table
from rich.text import Text

from crossover.protos.priority import name_of

__all__ = ["JSON_VERSION", "to_json", "queue_tables", "jobs_table"]

JSON_VERSION = 1

_PHASE_STYLE = {"COMPUTE": "bold green", "WAITING": "yellow", "COMM": "cyan", "OTHER": "dim", "IDLE": "dim",
                "SUSPENDED": "bold red", "OVERDUE": "bold red"}


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_UNKNOWN_WHEN_NEGATIVE = {"utilization", "cpu_percent"}  # -1 on the wire: not measured (a CPU device, a first read)


def to_json(kind: str, message: Any) -> dict[str, Any]:
    """`{"version": 1, "kind": ..., <message fields>}`; defaults included so keys are stable.

    Numbers stay numbers (protobuf's JSON mapping writes 64-bit integers as strings), a
    figure the daemon could not measure is null, not -1, and a rank's hand-over is `device` or
    `cpu`, as the table says it.
    """
    body = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _plain_numbers(message, body)
    return {"version": JSON_VERSION, "kind": kind, **body}


def _plain_numbers(message: Any, body: dict[str, Any]) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.name not in body:
            continue
        value, repeated = body[field.name], field.is_repeated
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for sub, sub_body in zip(getattr(message, field.name) if repeated else [getattr(message, field.name)],
                                     value if repeated else [value]):
                _plain_numbers(sub, sub_body)
        elif field.type in _INT64:
            body[field.name] = [int(v) for v in value] if repeated else int(value)
        elif field.name in _UNKNOWN_WHEN_NEGATIVE and not repeated and value < 0:
            body[field.name] = None
        elif field.name == "handover" and field.type == FieldDescriptor.TYPE_STRING and not value:
            body[field.name] = "cpu"  # the wire's "": its CPU waits for the device, as the table says


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}" if seconds else "-"


def _isolation(iso: dict[str, Any]) -> str:
    """The device's isolation controller in one phrase: the protected job's pace alone and now, the lower
    classes' budget and what each lower job held (device seconds per second, last window)."""
    ref, cur, target = float(iso.get("reference_s", 0)), float(iso.get("current_s", 0)), float(iso.get("target", 0))
    kept = float(iso.get("kept") or 0)
    pace = f"alone {1000 * ref:.0f} ms" if ref else "measuring it alone"
    if ref and cur:
        pace += f", now {1000 * cur:.0f} ms" + (f" ({kept:.2f}x, target {target:g})" if kept else "")
    got = ", ".join(f"{shown(job, 20).plain} {float(v):.2f}" for job, v in sorted(iso.get("lower_share", {}).items()))
    return (f"protect [{iso.get('window', '')}] {pace}; lower budget {float(iso.get('budget', 0)):.2f} s/s"
            + (f" (held: {got})" if got else ""))


def _bytes(n: int) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.0f}PiB"


def shown(value: Any, limit: int = 80) -> Text:
    """A string someone else chose (a job name, a device name), as plain text for the terminal.

    Never markup (a job named `[/bold]` is shown as written), never a control character
    (an ESC sequence in a name cannot clear the screen or retitle the window: shown as
    `\x1b`), and at most `limit` characters.
    """
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))
    return Text(text if len(text) <= limit else text[: limit - 1] + "…")


def _phase(rank: dict[str, Any]) -> Text:
    phase = rank.get("phase", "IDLE")
    return Text(phase.lower(), style=_PHASE_STYLE.get(phase, ""))


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


def queue_tables(state: dict[str, Any], width: int | None = None) -> list[Table]:
    """One table per device: holder first, then waiting ranks in grant order, then the rest.

    `hand-over` says how each rank ends its turns: on its device, or by its CPU waiting for the device.
    With a `width` (the terminal's), columns are dropped until the table fits: pid, hand-over, rss,
    gpu mem, cpu%, user, comm ms, iter, in that order (`crossover queue --wide` keeps them all).
    """
    tables = []
    for dev in state.get("devices", []):
        title = Text(f"device {dev['index']} (") + shown(dev["kind"]) + " " + shown(dev["name"]) + ")"
        extras = []
        if dev.get("draining"):
            refused = int(dev.get("refused_while_draining", 0))
            extras.append("DRAINING" + (f" ({refused} new rank{'s' * (refused != 1)} refused, unscheduled)"
                                        if refused else ""))
        util = dev.get("utilization")
        if util is not None and util >= 0:
            extras.append(f"util {util:.0f}%")
        if int(dev.get("memory_total_bytes", 0)):
            extras.append(_device_memory(dev))
        if dev.get("order"):
            extras.append("order " + " → ".join(shown(o, 40).plain for o in dev["order"]))
        if dev.get("sharing"):
            extras.append(f"{dev['sharing']} ({shown(dev.get('sharing_reason', ''), 80).plain})")
        if dev.get("isolation"):
            extras.append(_isolation(dev["isolation"]))
        if extras:
            title += Text("  " + "  ".join(extras))
        marked = [("holds", r) for r in dev.get("holders", [])]
        marked += [(f"#{i + 1}", r) for i, r in enumerate(dev.get("waiting", []))]
        marked += [("", r) for r in dev.get("others", [])]
        gpu = any(int(r.get("gpu_memory_bytes", 0)) for _, r in marked)
        capped = any("memory_cap_bytes" in r for _, r in marked)
        rows = []
        for mark, r in marked:
            cpu = r.get("cpu_percent")
            job = r.get("job_name", "") + (" (ddp)" if r.get("framework") == "ddp" else "")
            rows.append({"": Text(mark), "job": shown(job), "user": shown(r.get("user") or "-", 16),
                         "rank": Text(str(r.get("rank", 0))),
                         "pid": Text(str(r.get("pid", 0))), "phase": _phase(r),
                         "iter": Text(str(r.get("iteration", 0))),
                         "comp ms": Text(_ms(r.get("mean_compute_s", 0.0))),
                         "comm ms": Text(_ms(r.get("mean_comm_s", 0.0))),
                         "wait": Text(f"{100 * r.get('wait_fraction', 0.0):.0f}%"),
                         "hand-over": Text(r.get("handover") or "cpu"),
                         "cpu%": Text("-" if cpu is None or cpu < 0 else f"{cpu:.0f}"),
                         "rss": Text(_bytes(int(r.get("rss_bytes", 0)))),
                         "gpu mem": Text(_bytes(int(r.get("gpu_memory_bytes", 0)))),
                         "mem cap": Text(_cap(r))})
        columns = _fit([c for c in _QUEUE_COLUMNS if (gpu or c != "gpu mem") and (capped or c != "mem cap")], rows,
                       width)
        t = Table(title=title, title_justify="left", expand=False, pad_edge=False)
        for col in columns:
            t.add_column(col, justify="right" if col in _RIGHT else "left", no_wrap=True, min_width=_MIN_WIDTH.get(col))
        for row in rows:
            t.add_row(*(row[c] for c in columns))
        if not rows:
            t.add_row("", Text("idle: no ranks", style="dim"), *[""] * (len(columns) - 2))
        tables.append(t)
    return tables


def _device_memory(dev: dict[str, Any]) -> str:
    """`mem 61 GiB/80 GiB (19 GiB free; prod 50 GiB, batch 9 GiB)`: the device's memory and each job's there."""
    used, total, free = (int(dev.get(k, 0)) for k in ("memory_used_bytes", "memory_total_bytes", "memory_free_bytes"))
    per_job: dict[str, int] = {}
    for key in ("holders", "waiting", "others"):
        for r in dev.get(key, []):
            name = r.get("job_name", "")
            per_job[name] = per_job.get(name, 0) + int(r.get("gpu_memory_bytes", 0))
    jobs = ", ".join(f"{shown(job, 24).plain} {_bytes(n)}" for job, n in per_job.items() if n)
    inner = "; ".join(part for part in (f"{_bytes(free)} free" if free else "", jobs) if part)
    return f"mem {_bytes(used)}/{_bytes(total)}" + (f" ({inner})" if inner else "")


def _cap(r: dict[str, Any]) -> str:
    """A rank's memory cap: `-` for none, `0B` for a cap of nothing."""
    if "memory_cap_bytes" not in r:
        return "-"
    return _bytes(int(r["memory_cap_bytes"])) if int(r["memory_cap_bytes"]) else "0B"


def _job_memory(ranks: list[dict[str, Any]]) -> str:
    """Each device's share of the job here: `d0 9.1 GiB (cap 16 GiB)`; `-` when nothing is known."""
    per_device: dict[int, tuple[int, int | None]] = {}
    for r in ranks:
        used, cap = per_device.get(int(r.get("device", 0)), (0, None))
        if "memory_cap_bytes" in r:
            cap = (cap or 0) + int(r["memory_cap_bytes"])
        per_device[int(r.get("device", 0))] = (used + int(r.get("gpu_memory_bytes", 0)), cap)
    shown_ = [f"d{d} {_bytes(used)}" + ("" if cap is None else f" (cap {_bytes(cap) if cap else '0B'})")
              for d, (used, cap) in sorted(per_device.items()) if used or cap is not None]
    return ", ".join(shown_) or "-"


def jobs_table(state: dict[str, Any]) -> Table:
    t = Table(title="jobs on this node", title_justify="left")
    for col in ("job", "framework", "user", "id", "class", "world", "ranks here", "phases", "iter", "gpu mem",
                "registered s"):
        t.add_column(col)
    for job in state.get("jobs", []):
        ranks = job.get("ranks", [])
        phases = ", ".join(f"{r['rank']}:{r.get('phase', 'IDLE').lower()}" for r in ranks)
        iters = max((int(r.get("iteration", 0)) for r in ranks), default=0)
        users = sorted({r.get("user") for r in ranks if r.get("user")})
        klass = name_of(str(job.get("priority", ""))) or "normal"
        weight = float(job.get("weight") or 1.0)
        by = job.get("class_set_by") or ""
        klass += ("" if weight == 1.0 else f" x{weight:g}") + (f" ({shown(by, 20)})" if by else "")
        t.add_row(shown(job["job_name"]), shown(job.get("framework") or "-", 10), shown(",".join(users) or "-", 24),
                  shown(job["job_id"][:12]), klass,
                  str(job["world_size"]), str(len(ranks)), phases,
                  str(iters), _job_memory(ranks), f"{job.get('registered_s', 0.0):.0f}")
    notes = [f"{job['job_name']} rank {r.get('rank', 0)}: {r['memory_note']}" for job in state.get("jobs", [])
             for r in job.get("ranks", []) if r.get("memory_note")]
    if notes:
        t.caption = "\n".join(shown(n, 400).plain for n in notes)
        t.caption_justify = "left"
    if not state.get("jobs"):
        t.add_row(Text("no jobs registered", style="dim"), "", "", "", "", "", "", "", "", "", "")
    return t
