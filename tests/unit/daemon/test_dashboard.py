"""The Grafana dashboard in deploy/ is valid JSON and asks only for metrics the daemon exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.metrics import DaemonMetrics
from crossover.daemon.scheduler import Scheduler, SchedulerSettings

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "crossover-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
             "gauge": ("",)}
# A metric name in PromQL: not a function (followed by "("), not a label (followed by "=" or "!~"), not after "by (".
_NAME = re.compile(r"\b((?:crossover|process)_[a-z0-9_]+)\b(?!\s*[(=!~])")


def _exported() -> set[str]:
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]), SchedulerSettings(policy="crossover", node="n",
                                                                                    adapt=False))
    return {family.name + suffix for family in DaemonMetrics(core).registry.collect()
            for suffix in _SUFFIXES[family.type]}


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def test_the_dashboard_loads_and_every_panel_has_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"


def test_every_query_names_only_exported_metrics() -> None:
    exported = _exported()
    for expr in _queries(json.loads(DASHBOARD.read_text())):
        names = set(_NAME.findall(expr))
        assert names, f"{expr!r} names no crossover or process metric"
        assert names <= exported, f"{expr!r} asks for {sorted(names - exported)}, which the daemon does not export"


def test_the_checker_would_catch_a_misspelled_metric() -> None:
    assert _NAME.findall('rate(crossover_grant_total{instance=~"$i"}[1m])') == ["crossover_grant_total"]
    assert "crossover_grant_total" not in _exported()
