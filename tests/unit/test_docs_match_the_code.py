"""docs/operating.md and docs/metrics.md against the code: every flag and column they name exists,
every metric the daemon exports is documented (as the README's settings table is generated), and the
event log's tables list each event's fields as its record declares them."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from crossover.client.cli.formatting import _QUEUE_COLUMNS
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.main import main as crossoverd
from crossover.daemon.metrics import DaemonMetrics
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos.event_records import RECORDS
from crossover.protos.identity import RankIdentity

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_flag_in_operating_md_is_a_crossoverd_flag() -> None:
    text = (DOCS / "operating.md").read_text()
    named = set(re.findall(r"^\| `(--[a-z-]+)", text, re.M)) | set(re.findall(r"/ `(--[a-z-]+)`", text))
    flags = {opt for p in crossoverd.params for opt in (*p.opts, *p.secondary_opts)}
    assert named, "the flag table was not found"
    assert named <= flags, f"documented but not crossoverd flags: {sorted(named - flags)}"
    undocumented = {f for f in flags if f.startswith("--")} - set(re.findall(r"`(--[a-z-]+)", text)) - {"--help"}
    assert not undocumented, f"crossoverd flags docs/operating.md does not name: {sorted(undocumented)}"


def test_the_queue_example_shows_the_columns_the_table_has() -> None:
    text = (DOCS / "operating.md").read_text()
    example = text.split("## Reading `crossover queue`", 1)[1].split("```", 2)[1]
    header = next(line for line in example.splitlines() if "job" in line and "rank" in line)
    shown = re.split(r"\s{2,}", header.strip())
    assert shown == [c for c in _QUEUE_COLUMNS[1:] if c not in ("gpu mem", "mem cap")], shown  # a GPU's, capped
    assert re.search(r"streams \d+/\d+", example)


def test_every_exported_metric_is_documented() -> None:
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]),
                     SchedulerSettings(policy="crossover", node="n0", adapt=False), pid_alive=lambda _p: True)
    core.register(RankIdentity(job_id="j", job_name="j", rank=0, local_rank=0, world_size=1, local_size=1, device=0,
                               pid=1))
    metrics = DaemonMetrics(core)
    documented = set(re.findall(r"^\| `([a-z_*]+)`", (DOCS / "metrics.md").read_text(), re.M))
    for family in metrics.registry.collect():
        for sample in family.samples:
            name = sample.name
            base = re.sub(r"_(created|bucket|count|sum)$", "", name)
            ok = name in documented or base in documented or f"{base}_total" in documented or (
                name.endswith("_created") and "*_created" in documented) or (
                name.startswith("process_") and "process_*" in documented)
            assert ok, f"{name} is exported but docs/metrics.md does not list it"


def test_operating_md_lists_each_events_fields_as_its_record_declares_them() -> None:
    section = (DOCS / "operating.md").read_text().split("### The file", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|[^|\n]*\|([^|\n]*)\|$", section, re.M)
    documented = {name: re.findall(r"`([a-z_]+)`(\??)", fields) for name, fields in rows}
    declared = {str(name): [(f.name, "" if f.default is dataclasses.MISSING else "?")
                            for f in dataclasses.fields(record)] for name, record in RECORDS.items()}
    assert len(rows) == len(documented), "an event has two rows"
    assert documented == declared
