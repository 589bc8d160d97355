"""Replay recorded LB-BSP runs through the batch-size controller, offline and in seconds.

Every LB-BSP run of `bench/convergence/` keeps the measurements its ranks
shared (`lbbsp_stats()["trace"]`). This script feeds them to a fresh controller
on the plugin's own schedule (`crossover.plugins.aggregation.replay_decisions`):

* with the run's own settings it must reproduce the recorded size history;
  `same` says whether it does (no: the controller changed since the run, and
  the replay columns show what it decides now);
* with other settings (`--ema-alpha`, `--period`, `--method`, `--warmup`,
  `--hysteresis`, `--min-gain`) it shows what that rule would have decided on
  the same measurements, which is how a controller change is judged before a
  benchmark is spent on it.

The measurements were taken at the run's own sizes: once a replay's sizes leave
the recorded ones, what it decides rests on times measured at other sizes.

    python -m bench.lbbsp_replay results/convergence.json [--only straggler/mnist1d] [--ema-alpha 0.3]
        [--json results/replay.json] [--verbose]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from crossover.plugins.aggregation import replay_decisions
from crossover.plugins.aggregation.lbbsp.config import BatchSizeConfig, BatchSizeConfigError

_OVERRIDES = ("period", "ema_alpha", "method", "warmup", "hysteresis")
# The settings a results file without `lbbsp_config` (or `lbbsp_min_gain`) was recorded with.
_UNRECORDED_WARMUP, _UNRECORDED_HYSTERESIS, _UNRECORDED_MIN_GAIN = 5, 0.05, 0.1


def recorded_config(run: dict[str, Any], top: dict[str, Any]) -> tuple[BatchSizeConfig, float]:
    """The controller settings and min_gain the run was recorded with."""
    trace = run["trace"]
    saved = run.get("lbbsp_config")
    if saved:
        return BatchSizeConfig.from_dict(saved), float(run.get("lbbsp_min_gain") or _UNRECORDED_MIN_GAIN)
    config = BatchSizeConfig(global_batch=sum(b for b, _ in trace[0]), world_size=len(trace[0]),
                             period=top.get("period") or 10, ema_alpha=top.get("ema_alpha") or 0.3,
                             method=top.get("method") or "ema", warmup=_UNRECORDED_WARMUP,
                             hysteresis=_UNRECORDED_HYSTERESIS)
    return config, _UNRECORDED_MIN_GAIN


def replay(run: dict[str, Any], top: dict[str, Any], overrides: dict[str, Any],
           min_gain: Optional[float]) -> dict[str, Any]:
    trace = run["trace"]
    config, recorded_gain = recorded_config(run, top)
    recorded = [(int(start), [int(b) for b in sizes]) for start, sizes in run["size_history"]]
    initial = recorded[0][1]
    again = replay_decisions(config, trace, initial, recorded_gain)
    steps = len(trace)
    out: dict[str, Any] = {
        # Decisions up to the exchange read after the last traced step are replayable (a trace
        # stops at 5000 steps); that read comes at most two steps later.
        "recorded": recorded, "reproduces": again == [h for h in recorded if h[0] <= steps + 2], "steps": steps,
        "config": dataclasses.asdict(config), "min_gain": recorded_gain,
    }
    # Without overrides the replay is the current controller on the run's own settings: where it
    # differs from the record, that is what the controller decides now on the same measurements.
    other = dataclasses.replace(config, **overrides)
    gain = recorded_gain if min_gain is None else min_gain
    history = replay_decisions(other, trace, initial, gain) if overrides or min_gain is not None else again
    out.update(replayed=history, replayed_config=dataclasses.asdict(other), replayed_min_gain=gain)
    return out


def _steps(history: list[tuple[int, list[int]]]) -> str:
    """The steps the sizes changed at, e.g. ``12,22,57`` (``-``: never)."""
    return ",".join(str(start) for start, _ in history[1:]) or "-"


def _sizes(history: list[tuple[int, list[int]]]) -> str:
    return ",".join(map(str, history[-1][1]))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Runs without a trace (sync, Adasum) are skipped. Exit status: 0, 1 when "
                                            "a run is not reproduced with its own settings, 2 on bad input.")
    parser.add_argument("results", type=Path, help="a JSON file written by bench/convergence/")
    parser.add_argument("--only", default="", help="replay only runs whose name contains this text")
    parser.add_argument("--period", type=int, help="replay with this period instead of the recorded one")
    parser.add_argument("--ema-alpha", type=float, help="... with this moving-average weight")
    parser.add_argument("--method", choices=("ema", "numerical"), help="... with this speed model")
    parser.add_argument("--warmup", type=int, help="... leaving out this many first measurements per rank")
    parser.add_argument("--hysteresis", type=float, help="... with this hysteresis")
    parser.add_argument("--min-gain", type=float, help="... adopting only predicted gains above this")
    parser.add_argument("--json", type=Path, help="also write the replays here")
    parser.add_argument("--verbose", action="store_true", help="also print every size history in full")
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log keeps whole rows
    try:
        data = json.loads(args.results.read_text())
    except (OSError, ValueError) as exc:
        console.print(f"error: cannot read {args.results}: {exc}")
        return 2
    runs = {name: run for name, run in data.get("results", {}).items()
            if isinstance(run, dict) and run.get("trace") and args.only in name}
    if not runs:
        console.print(f"error: no LB-BSP run with a trace{' matching ' + repr(args.only) if args.only else ''} "
                      f"in {args.results}")
        return 2
    overrides = {key: getattr(args, key) for key in _OVERRIDES if getattr(args, key) is not None}
    try:
        replays = {name: replay(run, data, overrides, args.min_gain) for name, run in runs.items()}
    except BatchSizeConfigError as exc:
        console.print(f"error: {exc}")
        return 2
    alternative = bool(overrides) or args.min_gain is not None
    table = Table(title=f"LB-BSP replay of {args.results}"
                  + (f" with {overrides | ({'min_gain': args.min_gain} if args.min_gain is not None else {})}"
                     if alternative else ""))
    table.add_column("run", no_wrap=True)
    for column in ("steps", "same", "re-split at", "final sizes"):
        table.add_column(column, no_wrap=True)
    show_replay = alternative or not all(r["reproduces"] for r in replays.values())
    if show_replay:
        for column in ("replay: re-split at", "final sizes"):
            table.add_column(column, no_wrap=True)
    for name, r in replays.items():
        cells = [name.replace("/lbbsp", ""), str(r["steps"]), "yes" if r["reproduces"] else "[red]NO[/red]",
                 _steps(r["recorded"]), _sizes(r["recorded"])]
        if show_replay:
            cells += [_steps(r["replayed"]), _sizes(r["replayed"])]
        table.add_row(*cells)
    console.print(table)
    if args.verbose:
        for name, r in replays.items():
            console.print(f"{name}: recorded {r['recorded']}")
            if show_replay:
                console.print(f"{' ' * len(name)}  replayed {r['replayed']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"results": str(args.results), "overrides": overrides, "min_gain": args.min_gain, "replays": replays}
        args.json.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")
    return 0 if all(r["reproduces"] for r in replays.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
