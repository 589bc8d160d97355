"""Pure formatters for the CLI: protobuf replies → versioned JSON dicts → rich tables.

Kept free of I/O so they are tested directly and reused by `--watch`.
"""
from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from rich.table import Table
from rich.text import Text

__all__ = ["JSON_VERSION", "to_json", "queue_tables", "jobs_table"]

JSON_VERSION = 1

_PHASE_STYLE = {"COMPUTE": "bold green", "WAITING": "yellow", "COMM": "cyan", "OTHER": "dim", "IDLE": "dim",
                "SUSPENDED": "bold red", "OVERDUE": "bold red"}


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_UNKNOWN_WHEN_NEGATIVE = {"utilization", "cpu_percent"}  # -1 on the wire: not measured (a CPU device, a first read)


def to_json(kind: str, message: Any) -> dict[str, Any]:
    """`{"version": 1, "kind": ..., <message fields>}`; defaults included so keys are stable.

    Numbers stay numbers (protobuf's JSON mapping writes 64-bit integers as strings), and a
    figure the daemon could not measure is null, not -1.
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


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}" if seconds else "-"


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


def queue_tables(state: dict[str, Any]) -> list[Table]:
    """One table per device: holder first, then waiting ranks in grant order, then the rest."""
    tables = []
    for dev in state.get("devices", []):
        title = Text(f"device {dev['index']} (") + shown(dev["kind"]) + " " + shown(dev["name"]) + ")"
        extras = []
        if dev.get("draining"):
            extras.append("DRAINING")
        util = dev.get("utilization")
        if util is not None and util >= 0:
            extras.append(f"util {util:.0f}%")
        if int(dev.get("memory_total_bytes", 0)):
            extras.append(f"mem {_bytes(int(dev['memory_used_bytes']))}/{_bytes(int(dev['memory_total_bytes']))}")
        if dev.get("order"):
            extras.append("order " + " → ".join(shown(o, 40).plain for o in dev["order"]))
        if extras:
            title += Text("  " + "  ".join(extras))
        rows = [("holds", r) for r in dev.get("holders", [])]
        rows += [(f"#{i + 1}", r) for i, r in enumerate(dev.get("waiting", []))]
        rows += [("", r) for r in dev.get("others", [])]
        gpu = any(int(r.get("gpu_memory_bytes", 0)) for _, r in rows)
        t = Table(title=title, title_justify="left", expand=False, pad_edge=False)
        t.add_column("", no_wrap=True, min_width=5)  # "holds", "#12": one width from frame to frame
        t.add_column("job", no_wrap=True, min_width=6)
        for col in ("rank", "pid"):
            t.add_column(col, justify="right", no_wrap=True)
        t.add_column("phase", no_wrap=True, min_width=7)
        for col in ("iter", "comp ms", "comm ms", "wait", "cpu%", "rss") + (("gpu mem",) if gpu else ()):
            t.add_column(col, justify="right", no_wrap=True)
        for mark, r in rows:
            cpu = r.get("cpu_percent")
            cpu = -1 if cpu is None else cpu
            t.add_row(mark, shown(r.get("job_name", "")), str(r.get("rank", 0)), str(r.get("pid", 0)), _phase(r),
                      str(r.get("iteration", 0)), _ms(r.get("mean_compute_s", 0.0)), _ms(r.get("mean_comm_s", 0.0)),
                      f"{100 * r.get('wait_fraction', 0.0):.0f}%", f"{cpu:.0f}" if cpu >= 0 else "-",
                      _bytes(int(r.get("rss_bytes", 0))),
                      *((_bytes(int(r.get("gpu_memory_bytes", 0))),) if gpu else ()))
        if not rows:
            t.add_row("", Text("idle: no ranks", style="dim"), *[""] * 9)
        tables.append(t)
    return tables


def jobs_table(state: dict[str, Any]) -> Table:
    t = Table(title="jobs on this node", title_justify="left")
    for col in ("job", "id", "world", "ranks here", "phases", "iter", "registered s"):
        t.add_column(col)
    for job in state.get("jobs", []):
        ranks = job.get("ranks", [])
        phases = ", ".join(f"{r['rank']}:{r.get('phase', 'IDLE').lower()}" for r in ranks)
        iters = max((int(r.get("iteration", 0)) for r in ranks), default=0)
        t.add_row(shown(job["job_name"]), shown(job["job_id"][:12]), str(job["world_size"]), str(len(ranks)), phases,
                  str(iters), f"{job.get('registered_s', 0.0):.0f}")
    if not state.get("jobs"):
        t.add_row(Text("no jobs registered", style="dim"), "", "", "", "", "", "")
    return t
