"""bench.simulate's table of several runs per large scenario: medians, spreads and run-by-run ratios."""
from __future__ import annotations

import json

from rich.console import Console

from bench.simulate import pooled_table, run_large, runs_table


def _row(scenario: str, policy: str, run: int, thr: float) -> dict:
    return {"kind": "large", "scenario": scenario, "policy": policy, "run": run, "throughput_iter_s": thr}


def _text(table) -> str:
    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_runs_are_compared_by_their_medians_and_run_by_run():
    rows = [_row("static-3", "exclusive", r, t) for r, t in enumerate((10.0, 12.0, 14.0))]
    rows += [_row("static-3", "crossover", r, t) for r, t in enumerate((11.0, 11.0, 15.4))]
    lines = {line.split("│")[2].strip(): line for line in _text(runs_table(rows, 3)).splitlines()
             if line.count("│") > 3}
    cells = [c.strip() for c in lines["crossover"].split("│")]
    assert cells[3:8] == ["11.0", "11.0-15.4", "0.917", "0.917-1.100", "2/3"]
    assert [c.strip() for c in lines["exclusive"].split("│")][5:8] == ["1.000", "1.000-1.000", "3/3"]


def test_a_run_draws_its_own_luck_on_the_same_jobs():
    args = {"iters": 8, "seed": 0, "switch_penalty": 0.1, "spread": 0.2, "grant_latency_ms": 0.3,
            "link_sharing": "fifo", "interference": 0.0, "per_job": False}
    first, again, other = (run_large("static-2", "exclusive", args, run) for run in (0, 0, 1))
    assert (first["n_jobs"], first["n_ranks"]) == (other["n_jobs"], other["n_ranks"])
    assert first["throughput_iter_s"] == again["throughput_iter_s"] != other["throughput_iter_s"]
    assert (first["sim_seed"], other["sim_seed"]) == (0, 1000)


def test_files_pool_each_run_against_exclusive_on_its_own_jobs(tmp_path):
    # Two placements of different speeds: each run counts against exclusive's mean on the same jobs.
    slow = [_row("static-3", "exclusive", r, t) for r, t in enumerate((9.0, 11.0))]
    slow += [_row("static-3", "crossover", r, t) for r, t in enumerate((11.0, 11.0))]
    fast = [_row("static-3", "exclusive", r, t) for r, t in enumerate((20.0, 20.0))]
    fast += [_row("static-3", "crossover", r, t) for r, t in enumerate((18.0, 18.0))]
    files = []
    for name, rows in (("a", slow), ("b", fast)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"large": rows}))
    lines = [line for line in _text(pooled_table(files)).splitlines() if "static-3" in line and "crossover" in line]
    cells = [c.strip() for c in lines[0].split("│")]
    assert cells[3:5] == ["4", "1.000"]  # (1.1 + 1.1 + 0.9 + 0.9) / 4 against exclusive's 1.0
