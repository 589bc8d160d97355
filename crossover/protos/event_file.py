"""The event log's contract: every event's name, its entry, and its file (one JSON object per line).

The daemon writes it (`crossover.daemon.event_log`, with `crossoverd --event-log`); the CLI
(`crossover stats`, `timeline`), the metrics, the test beds and the benchmarks read it, through this
module, `crossover.protos.event_records` (each event's payload as a typed record) and
`crossover.protos.event_phases`. A line is a flat object, readable with `jq`:

    {"t": <monotonic s>, "wall": <unix s>, "event": <EventName>, [job, job_name, rank, device, node,] <payload>}

Each file starts with a header line, `{"event": "log_format", "format": FORMAT, ...}`; a file without
one is of format 1 (logs before the header). A file of a newer format fails to load with one line
(`UnsupportedLog`). The daemon rotates the file (`path` → `path.1` → … `path.N`); `read_events` reads
the rotated files too, oldest first. docs/operating.md lists each event's fields, as its record declares them.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossover.errors import CrossoverError

__all__ = ["FORMAT", "Event", "EventName", "UnsupportedLog", "encode", "has_header", "header", "read_events",
           "read_jsonl", "rotated_paths", "typed"]

FORMAT = 1
"""The file format this code writes and reads; a log of a higher one is refused (`UnsupportedLog`)."""
_HEADER = "log_format"


class EventName(str, enum.Enum):
    """Every event the daemon writes. About a rank (with job, job_name, rank, device, node):"""

    REGISTER = "register"
    LEAVE = "leave"
    REQUEST = "request"
    GRANT = "grant"
    RELEASE = "release"
    CANCEL = "cancel"
    COMM_BEGIN = "comm_begin"
    COMM_END = "comm_end"
    OVERDUE = "overdue"
    OVERDUE_DONE = "overdue_done"
    SUSPEND = "suspend"
    RESUME = "resume"  # a suspended rank spoke again; without a rank: a drained device resumed
    LEASE = "lease"
    LEASE_REVOKE = "lease_revoke"
    LEASE_RELEASED = "lease_released"
    LEASE_EXPIRED = "lease_expired"
    JOB_CLASS = "job_class"
    PREEMPT = "preempt"
    HANDOVER = "handover"
    HANDOVER_RESCUE = "handover_rescue"
    DRAIN_REFUSED = "drain_refused"
    MEMORY_CAP = "memory_cap"  # its cap on its device changed: cap_bytes (None: no cap), why
    MEMORY_CAP_HIT = "memory_cap_hit"  # its allocator refused an allocation at its cap: asked_bytes, cap_bytes
    # About the node or a device (no rank):
    POLICY = "policy"
    DRAIN = "drain"
    EVICT = "evict"
    SHARING = "sharing"
    ISOLATION = "isolation"
    ADAPT = "adapt"
    HANDOVER_SWITCH = "handover_switch"
    JOB_CLASS_SET = "job_class_set"

    def __str__(self) -> str:
        return self.value


class UnsupportedLog(CrossoverError, ValueError):
    """An event log this code cannot read: written in a newer format."""


@dataclass(frozen=True)
class Event:
    """One event-log entry: its name, when (`t`, the daemon's monotonic clock; `wall`), and its fields.

    `name` is an `EventName`, or the plain text of a name this code does not know (a newer daemon's);
    `fields` holds everything else on the line, as written: the properties below read the rank an event is
    about (or the device, the job an event about the node names), and its record reads the payload
    (`crossover.protos.event_records`: `Grant.of(event)`).
    """

    name: EventName | str
    t: float
    wall: float = 0.0
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def job(self) -> str | None:
        return self.fields.get("job")

    @property
    def job_name(self) -> str | None:
        return self.fields.get("job_name")

    @property
    def rank(self) -> int | None:
        return self.fields.get("rank")

    @property
    def device(self) -> int | None:
        return self.fields.get("device")

    @property
    def node(self) -> str | None:
        return self.fields.get("node")

    @property
    def about_rank(self) -> bool:
        return "rank" in self.fields and "job" in self.fields

    def to_json(self) -> dict[str, Any]:
        """The line's object: `t`, `wall`, `event`, then the fields in their order."""
        return {"t": self.t, "wall": self.wall, "event": str(self.name), **self.fields}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event | None:
        """The event a line's object holds; None for one that is not an event (no name, no numeric `t`)."""
        name, t = obj.get("event"), obj.get("t")
        if not isinstance(name, str) or isinstance(t, bool) or not isinstance(t, (int, float)) or t != t:
            return None
        try:
            known: EventName | str = EventName(name)
        except ValueError:
            known = name
        wall = obj.get("wall")
        fields = {k: v for k, v in obj.items() if k not in ("t", "wall", "event")}
        return cls(known, float(t), float(wall) if isinstance(wall, (int, float)) else 0.0, fields)


def typed(entries: Iterable[Event | Mapping[str, Any]]) -> list[Event]:
    """The events among `entries` (`Event`s, or line objects: an in-memory log's, `read_jsonl`'s), in order."""
    out: list[Event] = []
    for e in entries:
        event = e if isinstance(e, Event) else Event.from_json(e) if isinstance(e, Mapping) else None
        if event is not None:
            out.append(event)
    return out


def header(**about: Any) -> str:
    """The first line of a new file: its format, and what the writer says of itself."""
    return json.dumps({"event": _HEADER, "format": FORMAT, **about}, separators=(",", ":")) + "\n"


def encode(entry: Mapping[str, Any]) -> str:
    """One entry's line."""
    return json.dumps(entry, separators=(",", ":")) + "\n"


def rotated_paths(path: str | Path, backups: int) -> list[Path]:
    """The file and its rotated copies, newest first: `path`, `path.1`, …, `path.<backups>`."""
    p = Path(path)
    return [p, *(p.with_name(f"{p.name}.{n}") for n in range(1, backups + 1))]


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:  # a torn last line: the daemon was writing it
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("event") == _HEADER:
                fmt = obj.get("format")
                if n == 0 and isinstance(fmt, int) and fmt > FORMAT:
                    raise UnsupportedLog(f"{path}: event log format {fmt}; this crossover reads up to {FORMAT} "
                                         "(upgrade it to read this log)")
                continue
            yield obj


def has_header(path: str | Path) -> bool:
    """Whether the file starts with a log's header line (a crossoverd event log, perhaps with no event yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.loads(f.readline(4096))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("event") == _HEADER


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One file's entries as the objects of their lines, the header left out (UnsupportedLog: a newer format)."""
    return list(_lines(Path(path)))


def read_events(path: str | Path, backups: int | None = None) -> list[Event]:
    """The events of a log file and of its rotated copies beside it (`path.1`, `path.2`, …: every one there,
    or up to `backups`), oldest first.

    Lines that are no event are skipped; UnsupportedLog for a file of a newer format."""
    if backups is None:
        backups = 0
        while Path(f"{path}.{backups + 1}").exists():
            backups += 1
    out: list[Event] = []
    for p in reversed(rotated_paths(path, backups)):
        if p.exists():
            out += [e for e in map(Event.from_json, _lines(p)) if e is not None]
    return out
