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


def _pooled_cells(tmp_path, files_rows: list[list[dict]]) -> dict[str, list[str]]:
    files = []
    for i, rows in enumerate(files_rows):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps({"large": rows}))
    return {line.split("│")[2].strip(): [c.strip() for c in line.split("│")] for line in
            _text(pooled_table(files)).splitlines() if "static-3" in line}


def test_files_pool_each_run_against_exclusive_in_the_same_run(tmp_path):
    # Two placements of different speeds: a run counts against exclusive's run with the same seed.
    slow = [_row("static-3", "exclusive", r, 10.0) for r in range(2)]
    slow += [_row("static-3", "crossover", r, 11.0) for r in range(2)]
    fast = [_row("static-3", "exclusive", r, 20.0) for r in range(2)]
    fast += [_row("static-3", "crossover", r, 18.0) for r in range(2)]
    cells = _pooled_cells(tmp_path, [slow, fast])["crossover"]
    assert cells[3:6] == ["4", "1.000", "0.115"]  # ratios 1.1 1.1 0.9 0.9: sd 0.1155, 2 SE over 4 runs


def test_a_policy_that_matches_exclusive_run_for_run_shows_no_noise(tmp_path):
    runs = [_row("static-3", p, r, t) for p in ("exclusive", "crossover") for r, t in enumerate((10.0, 20.0))]
    cells = _pooled_cells(tmp_path, [runs])
    assert cells["crossover"][4:6] == ["1.000", "0.000"]
    assert cells["exclusive"][5:7] == ["-", "0.471"]  # its own runs: 10 and 20 about their mean of 15
