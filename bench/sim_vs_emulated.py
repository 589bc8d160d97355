"""The simulator against the emulated cluster: same scenarios, same modes, throughput side by side.

Reads what `bench/emulated/` wrote. For each scenario the simulator gets the
phase times that run measured with each job alone (C, M). It also gets one
interference factor x. While a compute phase and an allreduce share a device,
each runs at 1/(1+x). x comes from the same run's phase times: how much longer
a compute phase took under `crossover` than alone. Only phase lengths go in;
throughput is what is compared. Each mode is simulated with both link models
(`fifo` and `fair`; see `testbed.simulator`).

A run on the device model (`bench.emulated --device model`) needs no
estimate: the simulator gets the model's own switch penalty and interference
(compute only: the emulated allreduce is real TCP, which the device does not
slow), and the tolerance is 5 %, since both then model one device the same way.

Checks, per scenario:
- each mode's simulated throughput within 15 % of the emulated one (5 % on the device model);
- the modes in the same order. Modes within 1 % of each other in the emulation
  count as tied, so a tie is not called a disagreement.

    python -m bench.sim_vs_emulated results/emulated.json [--interference X] [--out results/sim_vs_emulated.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.lib.results import machine, write_json
from testbed.simulator import simulate_small

MODES = {"sequential": "sequential", "unscheduled": "passthrough", "exclusive": "exclusive", "crossover": "crossover"}
LINKS = ("fifo", "fair")
TOLERANCE = 0.15
DEVICE_TOLERANCE = 0.05
TIE = 0.01


def measured_interference(scenario: dict[str, Any]) -> float:
    """How much longer a compute phase took under crossover than alone.

    Under crossover a device computes for one job at a time, so a compute phase
    is only stretched by the allreduces beside it. A comm phase is not used: it
    is also stretched by other jobs' allreduces on the same link, which the
    simulator models by itself.
    """
    return max(0.0, scenario["modes"]["crossover"]["C_ms"] / scenario["alone_C_ms"] - 1.0)


def same_order(emulated: dict[str, float], simulated: dict[str, float]) -> bool:
    """No pair of modes ranked the other way round, except pairs the emulation cannot tell apart."""
    modes = list(emulated)
    for i, a in enumerate(modes):
        for b in modes[i + 1:]:
            if abs(emulated[a] - emulated[b]) <= TIE * max(emulated[a], emulated[b]):
                continue
            if (emulated[a] - emulated[b]) * (simulated[a] - simulated[b]) < 0:
                return False
    return True


def compare(scenario: dict[str, Any], interference: float | None, iters: int,
            device: dict[str, float] | None = None) -> dict[str, Any]:
    """One scenario in both link models; `device`: the run's device model (setup.device_model), if any."""
    c, m = scenario["alone_C_ms"] / 1000, scenario["alone_M_ms"] / 1000
    world: dict[str, Any] = {"n_nodes": scenario.get("nodes", 2)}
    if device is not None:
        x = device["interference"] if interference is None else interference
        world.update(switch_penalty=device["switch_us"] / device["slice_us"], comm_interference=0.0)
        tolerance = DEVICE_TOLERANCE
    else:
        x = measured_interference(scenario) if interference is None else interference
        tolerance = TOLERANCE
    emulated = {mode: scenario["modes"][mode]["aggregate_samples_per_s"] / scenario["global_batch"] for mode in MODES}
    out: dict[str, Any] = {"scenario": scenario["scenario"], "C_ms": 1000 * c, "M_ms": 1000 * m, "interference": x,
                           "emulated_iter_s": emulated, "links": {}}
    for link in LINKS:
        sim = {mode: simulate_small(c, m, scenario["jobs"], policy, iterations=iters, link_sharing=link,
                                    interference=x, **world)["throughput_iter_s"] for mode, policy in MODES.items()}
        errors = {mode: sim[mode] / emulated[mode] - 1 for mode in MODES}
        out["links"][link] = {"iter_s": sim, "error": errors,
                              "within": all(abs(e) <= tolerance for e in errors.values()), "tolerance": tolerance,
                              "same_order": same_order(emulated, sim)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("emulated", type=Path, help="JSON written by bench/emulated/")
    p.add_argument("--interference", type=float, default=None,
                   help="use this x for every scenario instead of each one's measured phase stretch (0: none)")
    p.add_argument("--iters", type=int, default=200, help="simulated iterations per job")
    p.add_argument("--out", type=Path, default=Path("results/sim_vs_emulated.json"))
    args = p.parse_args()
    try:
        data = json.loads(args.emulated.read_text())
        # simulate_small models identical jobs that all share every node's device, for the whole run
        scenarios = [s for s in data["scenarios"]
                     if not s.get("batch_scale") and not s.get("placement") and not s.get("visitor")]
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"sim_vs_emulated: {args.emulated} is not a bench/emulated/ result: {exc}")
    device = data.get("setup", {}).get("device_model")
    rows = [compare(s, args.interference, args.iters, device) for s in scenarios]

    t = Table(title=f"simulator vs emulated cluster ({args.emulated}), iterations/s over all jobs")
    for col in ("scenario", "x", "mode", "emulated", *(f"sim {link}" for link in LINKS)):
        t.add_column(col, justify="right")
    for r in rows:
        for i, mode in enumerate(MODES):
            cells = [f"{r['links'][link]['iter_s'][mode]:.2f} ({100 * r['links'][link]['error'][mode]:+.0f}%)"
                     for link in LINKS]
            t.add_row(r["scenario"] if i == 0 else "", f"{r['interference']:.3f}" if i == 0 else "", mode,
                      f"{r['emulated_iter_s'][mode]:.2f}", *cells)
        t.add_row("", "", f"within {100 * r['links'][LINKS[0]]['tolerance']:.0f} %, same order", "",
                  *(f"{'yes' if r['links'][link]['within'] else 'no'}, "
                    f"{'yes' if r['links'][link]['same_order'] else 'no'}" for link in LINKS), end_section=True)
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    write_json(args.out, {"benchmark": "sim_vs_emulated", "time": time.time(), "machine": machine(),
                          "emulated": str(args.emulated), "args": {**vars(args), "emulated": str(args.emulated),
                                                                    "out": str(args.out)}, "scenarios": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
