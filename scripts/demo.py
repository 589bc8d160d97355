"""`make demo`: two co-located training jobs on a two-node emulated cluster, unscheduled and then scheduled.

Two nodes are network namespaces with shaped links, each with its own crossoverd
managing one CPU core as the node's device. Two identical jobs, each a real
`horovodrun` job (or, with `--framework ddp`, a DDP job started by one `torchrun` per
node) with `import crossover.auto` as its first line and one rank per node, train side
by side. They are measured the way the benchmark measures them
(`python -m bench.emulated --quick`): the jobs start once and the daemons switch
policy every few seconds, so unscheduled (`passthrough`) and scheduled
(`crossover`, and the other policies) segments interleave and see the same machine.

It ends with both jobs' samples/s unscheduled, under plain FIFO (`exclusive`) and
under `crossover`, crossover's ratio to each, and two timeline pictures drawn by
`crossover timeline` from the daemons' event logs: a few seconds of each mode, side
by side in time on every node's device.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from crossover.client.cli.event_intervals import merge_logs, policy_changes
from crossover.protos.event_file import read_events
from testbed.cluster import preflight
from testbed.harness.daemon import BIN

console = Console()
ROOT = Path(__file__).resolve().parents[1]
_SETTLE_S = 2.0
_WINDOW_S = 3.0


def _window(logs: list[Path], policy: str) -> tuple[float, float] | None:
    """Seconds (from the logs' first event, on the clock `crossover timeline` uses) of a stretch under
    `policy`, after the switch has settled."""
    events = merge_logs([read_events(log) for log in logs])
    switches = [t for t, new in policy_changes(events) if new == policy]
    if not switches:
        return None
    since = switches[0] + _SETTLE_S
    return since, since + _WINDOW_S


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=2, help="interleaved cycles through the modes (more: steadier)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "demo", help="folder for the results")
    p.add_argument("--device", choices=("core", "model"), default="core",
                   help="core: a CPU core is each node's device; model: a GPU-like emulated device "
                        "(docs/emulated-cluster.md)")
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                   help="horovod: horovodrun jobs; ddp: DistributedDataParallel jobs under torchrun (Gloo)")
    args = p.parse_args()
    reasons = preflight()
    if reasons:
        console.print(f"[red]the demo builds a two-node emulated cluster and cannot here:[/] {'; '.join(reasons)}")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    work, result = args.out / "work", args.out / "emulated.json"
    console.rule(f"[bold]Crossover demo[/]: two co-located {'DDP' if args.framework == 'ddp' else 'Horovod'} jobs on "
                 "two emulated nodes")
    bench = [sys.executable, "-m", "bench.emulated", "--quick", "--cycles", str(args.cycles), "--out", str(result),
             "--timeline", str(args.out / "bench_timeline.png"), "--workdir", str(work), "--device", args.device,
             "--framework", args.framework]
    console.print("$ python " + " ".join(bench[1:]))
    if subprocess.run(bench, cwd=ROOT).returncode != 0:
        console.print(f"[red]the run failed; logs are under {work}[/]")
        return 1

    summary = json.loads(result.read_text())["scenarios"][0]
    modes = summary["modes"]
    logs = sorted((work / "1-1_x2" / "cluster").glob("node*.events.jsonl"))
    pictures = []
    for mode, policy in (("unscheduled", "passthrough"), ("crossover", "crossover")):
        window = _window(logs, policy)
        if window is None:
            continue
        png = args.out / f"timeline_{mode}.png"
        cmd = [str(BIN / "crossover"), "timeline", *map(str, logs), "-o", str(png), "--since", f"{window[0]:.2f}",
               "--until", f"{window[1]:.2f}", "--title", f"{mode} ({policy}): {_WINDOW_S:.0f} s on both nodes"]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
            pictures.append(png)
    unscheduled = modes["unscheduled"]["aggregate_samples_per_s"]
    scheduled = modes["crossover"]["aggregate_samples_per_s"]
    fifo = modes["exclusive"]["aggregate_samples_per_s"]
    console.rule("[bold]Result[/]")
    console.print(f"event logs: {' '.join(map(str, logs))}")
    for png in pictures:
        console.print(f"timeline:   {png}")
    console.print(f"unscheduled: {unscheduled:8.0f} samples/s (both jobs)")
    console.print(f"FIFO:        {fifo:8.0f} samples/s (both jobs, policy exclusive)")
    console.print(f"crossover:   {scheduled:8.0f} samples/s (both jobs)")
    console.print(f"crossover vs unscheduled: {modes['crossover']['vs_unscheduled']:.2f}x, vs FIFO: "
                  f"{modes['crossover']['vs_unscheduled'] / modes['exclusive']['vs_unscheduled']:.2f}x "
                  f"(medians of {args.cycles} interleaved cycles; {100 * modes['crossover']['of_bound']:.0f}% of "
                  f"the pipeline bound; device: {'a CPU core' if args.device == 'core' else 'the GPU-like model'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
