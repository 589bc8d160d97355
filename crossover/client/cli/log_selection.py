"""What `crossover timeline` and `crossover stats` read: event-log files, a window, some jobs."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import click

from crossover.client.cli import event_intervals
from crossover.client.cli._common import ExitCode, Fail
from crossover.protos.event_file import Event, has_header, read_events

__all__ = ["Selection", "with_log_options"]


def _seconds(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter("must be a finite number of seconds", param=param)
    return value


_LOG_OPTIONS = [
    click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)),
    click.option("--since", type=float, callback=_seconds, metavar="SECONDS",
                 help="Start this many seconds after the first event (negative: before the last one)."),
    click.option("--until", type=float, callback=_seconds, metavar="SECONDS",
                 help="End this many seconds after the first event (negative: before the last one)."),
    click.option("--job", "job_names", multiple=True, metavar="NAME",
                 help="Only this job, by name or id (repeat for more)."),
]


def with_log_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the log files, the window (--since, --until) and the jobs (--job) a `Selection` takes."""
    for opt in reversed(_LOG_OPTIONS):
        fn = opt(fn)
    return fn


class Selection:
    """The phases of the chosen jobs in the chosen window of the given logs."""

    def __init__(self, files: Sequence[Path], since: float | None, until: float | None,
                 job_names: Sequence[str]) -> None:
        unique: dict[Path, Path] = {}
        for path in files:
            unique.setdefault(path.resolve(), path)  # a file named twice is read once
        logs = [_read_log(path) for path in unique.values()]
        if not any(logs):
            raise Fail(f"{', '.join(map(str, unique.values()))}: no events yet (a daemon's log holds only its header "
                       "until a rank registers)", ExitCode.ERROR)
        events = event_intervals.merge_logs([log for log in logs if log])
        self.log = event_intervals.read_phases(events)
        self.policy_changes = event_intervals.policy_changes(events)
        self.operator_marks = event_intervals.operator_marks(events)
        try:
            self.jobs = event_intervals.select_jobs(self.log, job_names)
        except event_intervals.UnknownJob as exc:
            raise Fail(str(exc), ExitCode.USAGE) from None
        self.since, self.until = event_intervals.window(self.log, since, until)
        span = self.log.last - self.log.first
        if self.since >= self.until:
            raise Fail(f"empty window: {_s(self.since - self.log.first)} s to {_s(self.until - self.log.first)} s "
                       f"(the log spans 0 to {span:.1f} s)", ExitCode.USAGE)
        self.devices = sorted({iv.device_key for iv in self.log.intervals if iv.job in self.jobs})
        self.intervals = event_intervals.clip((iv for iv in self.log.intervals if iv.job in self.jobs),
                                              self.since, self.until)
        if not self.intervals:
            whose = f" of {', '.join(job_names)}" if job_names else ""
            raise Fail(f"no phases{whose} between {self.since - self.log.first:.1f} s and "
                       f"{self.until - self.log.first:.1f} s (the log spans 0 to {span:.1f} s)", ExitCode.ERROR)


def _s(seconds: float) -> str:
    """Seconds as a window's edge is said: tenths, or three digits for a number too large to read out."""
    return f"{seconds:.1f}" if abs(seconds) < 1e7 else f"{seconds:.3g}"


def _read_log(path: Path) -> list[Event]:
    """The events of one file (none for a fresh log); a one-line `Fail` for a file missing, unreadable or no log."""
    if not path.exists():
        raise Fail(f"no such file: {path}", ExitCode.USAGE)
    try:
        events = read_events(path)
    except UnicodeDecodeError:
        raise Fail(f"{path} is not a crossoverd event log (it is not text)", ExitCode.ERROR) from None
    except (OSError, ValueError) as exc:
        raise Fail(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", ExitCode.ERROR) from None
    if not events and not has_header(path):  # a fresh log holds its header alone: it is read as empty
        raise Fail(f"{path} holds no crossoverd events (is it a crossoverd --event-log file?)", ExitCode.ERROR)
    return events
