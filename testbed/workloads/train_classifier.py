"""Train a small classifier on real data under `horovodrun`, with the plugin's aggregation rules.

Data ships with a package or is generated, never downloaded: scikit-learn's
bundled `load_digits` (8x8 digits; fixed 80/20 split) or MNIST-1D generated
locally by `mnist1d.data.make_dataset` (4000 train / 1000 test; pass --data to
reuse a cached `.npz`). Models: an MLP or a small CNN.

One job runs one or more training runs in sequence (`--runs`, a JSON list),
each from the same seed with a fresh model, optimizer and LB-BSP sampler, so
the start-up cost of a 4-rank job is paid once. Per run: model and width
(default: --model, --width), aggregation rule
(`rule`: average, sum, adasum, weighted, or null for plain Horovod), global
batch, learning rate, epochs, an optional straggler (`"3:3.0"`, see
`testbed.faults`; `straggler_work` `busy` or `sleep`), paces that change
during the run (`drift`: `"5:3@20-60"`, seconds of the run's training), LB-BSP
settings. Test accuracy is measured on every rank several times per epoch on
a clock that excludes evaluation. Each rank writes `rank{r}.json` to --out.
Consecutive runs with the same `interleave` key train together, a few steps
of each in turn (evaluation to evaluation, `interleave_order`), each on its own clock: on a loaded machine
two runs compared that way see its speed drift alike.

`--checkpoint DIR`: rank 0 saves each run at every epoch's end to `DIR/NAME.pt`
(model, optimizer, curve), and a run whose file exists resumes from it the way
Horovod's examples do: rank 0 loads it, then `broadcast_parameters` and
`broadcast_optimizer_state` give every rank the same start.

`--pace K` emulates one independent device per rank on a machine with fewer
cores than ranks: a rank's compute phase (batch fetch, forward, backward) is stretched
with a sleep to `K x` its CPU time, so its duration no longer depends on how
the OS shares the cores among ranks (K must exceed the ranks per core). The
straggler then stretches that phase by its factor. Without pacing, a rank
that waits in the allreduce hands its core to the others, so wall-clock
speeds measured on an oversubscribed machine reflect scheduling, not work.
"""
import argparse
import dataclasses
import json
import math
import os
import time
import warnings
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn

from crossover.plugins import aggregation
from crossover.plugins.aggregation.lbbsp.sampler import LBBSPSampler
from crossover.settings import AggregationSettings
from testbed.faults import Drift, Stall, Straggler
from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import write_rank_summary

DEFAULT_RUN: dict = {
    "name": "run", "rule": None, "global_batch": 64, "lr": 0.05, "momentum": 0.9, "epochs": 5, "seed": 0,
    "straggler": "", "straggler_work": "busy", "period": None, "hysteresis": None, "method": None,
    "evals_per_epoch": 4, "adasum_impl": None, "target": None, "stop_at_target": False, "max_train_s": None,
    "pace": None, "model": None, "width": None, "ema_alpha": None, "stall": "", "drift": "", "env": {},
    "interleave": None, "interleave_order": None,
}


def load_data(name: str, cache: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if name == "digits":
        from testbed.workloads.digits import load_digits

        x, y = load_digits()
        x = (x / 16.0).astype(np.float32)
        order = np.random.default_rng(0).permutation(len(x))
        cut = int(0.8 * len(x))
        tr, te = order[:cut], order[cut:]
        return x[tr], y[tr].astype(np.int64), x[te], y[te].astype(np.int64)
    if cache and os.path.exists(cache):
        d = np.load(cache)
        x, y, xt, yt = d["x"], d["y"], d["x_test"], d["y_test"]
    else:
        x, y, xt, yt = make_mnist1d()
        if cache:
            np.savez(cache, x=x, y=y, x_test=xt, y_test=yt)
    mean, std = x.mean(), x.std()
    return ((x - mean) / std).astype(np.float32), y, ((xt - mean) / std).astype(np.float32), yt


def make_mnist1d() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-1D from its generator (seed 42 by default); no network access."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mnist1d.data import get_dataset_args, make_dataset

        data = make_dataset(get_dataset_args())
    return (data["x"].astype(np.float32), data["y"].astype(np.int64),
            data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))


def build_model(kind: str, dataset: str, width: int) -> nn.Module:
    features = 64 if dataset == "digits" else 40
    if kind == "mlp":
        return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))
    c = max(8, width // 8)
    if dataset == "digits":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(2 * c * 16, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 40)), nn.Conv1d(1, c, 5, stride=2, padding=2), nn.ReLU(),
                         nn.Conv1d(c, c, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv1d(c, c, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(c * 5, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        acc = float((logits.argmax(1) == y).float().mean())
        loss = float(nn.functional.cross_entropy(logits, y))
    model.train()
    return acc, loss


def _sleep_work() -> None:  # a slower device that does not compete for this machine's cores
    time.sleep(0.0005)


def straggler_for(spec: dict) -> Straggler:
    return Straggler.for_rank(spec["straggler"], hvd.rank(),
                              work=_sleep_work if spec["straggler_work"] == "sleep" else None)


def drift_for(spec: dict) -> Drift:
    return Drift.for_rank(spec["drift"], hvd.rank(), work=_sleep_work if spec["straggler_work"] == "sleep" else None)


def interleaved(specs: list[dict], data: tuple, args: argparse.Namespace) -> list[dict]:
    """Train several runs a few steps at a time in turn, each on its own clock.

    Built in the order given (an LB-BSP run's weighting follows the newest sampler, so it must be
    built last), then stepped from one evaluation to the next, in `interleave_order` (indices of
    `specs`, default their order). Runs compared this way see the machine's speed as it drifts
    alike, which back-to-back runs of a few seconds each do not on a loaded machine.
    """
    runs = [training(spec, data, args) for spec in specs]
    for run in runs:
        next(run)  # built, not yet trained
    results: list[dict | None] = [None] * len(runs)
    order = specs[0]["interleave_order"] or list(range(len(specs)))
    while any(result is None for result in results):
        for i in order:
            if results[i] is None:
                try:
                    next(runs[i])
                except StopIteration as done:
                    results[i] = done.value
    return [result for result in results if result is not None]


def training(spec: dict, data: tuple, args: argparse.Namespace):  # noqa: ANN201 - a generator of the run
    """One run as a generator: it yields once when built, after every evaluation (several per epoch) and at
    every epoch's end, always off its clock, and returns its record."""
    x, y, xt, yt = data
    torch.manual_seed(spec["seed"])
    model = build_model(spec["model"] or args.model, args.dataset, spec["width"] or args.width)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    aggregation.set_aggregation(spec["rule"], adasum_impl=spec["adasum_impl"])
    run_env = {**os.environ, **{key: str(value) for key, value in spec["env"].items()}}  # CROSSOVER_* for this run
    aggregation.use_settings(AggregationSettings.from_env(run_env))
    knobs = {key: spec[key] for key in ("period", "hysteresis", "method", "ema_alpha") if spec[key] is not None}
    try:
        sampler = aggregation.batch_sampler(len(x), spec["global_batch"], seed=spec["seed"], drop_last=True,
                                            lbbsp=dataclasses.replace(aggregation.settings().lbbsp, **knobs))
        opt = aggregation.DistributedOptimizer(base, named_parameters=model.named_parameters())
    finally:
        aggregation.set_aggregation(None)
        aggregation.use_settings(None)
    saved_at = Path(args.checkpoint) / f"{spec['name']}.pt" if args.checkpoint else None
    resumed = _resume(saved_at, model, opt)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    straggler, drift = straggler_for(spec), drift_for(spec)
    stall = Stall.for_rank(spec["stall"], hvd.rank(), seed=spec["seed"])
    steps_per_epoch = len(sampler)
    eval_every = max(1, steps_per_epoch // spec["evals_per_epoch"])
    if resumed is None:
        acc, loss = accuracy(model, xt, yt)
        curve = [[0.0, 0, 0.0, acc, loss]]
        first_epoch, train_s, step = 0, 0.0, 0
    else:
        first_epoch, curve, train_s, step = resumed["epoch"], resumed["curve"], resumed["train_s"], resumed["step"]
    compute_s, extra_s = 0.0, 0.0
    stop = False
    yield
    grouped = spec["rule"] == "group_async"  # groups hold different models: no shared stop decision
    # Interleaved: each stretch ends once every rank has finished its work (a straggler's extra time
    # comes after its backward pass), so none of it is charged to the next run's clock.
    together = spec["interleave"] is not None
    pace = args.pace if spec["pace"] is None else spec["pace"]
    for epoch in range(first_epoch, spec["epochs"]):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        batches = iter(loader)
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()  # the compute phase includes fetching the batch
            try:
                xb, yb = next(batches)
            except StopIteration:
                break
            if grouped:  # the sampler's boundaries (waits for other groups) are no compute
                t0, c0 = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            real = time.perf_counter() - t0
            if pace > 0:
                paced = pace * (time.thread_time() - c0)
                if paced > real:
                    time.sleep(paced - real)
                real = max(real, paced)
            compute_s += real
            at_s = train_s + time.perf_counter() - started  # this run's own training clock
            extra_s += straggler.slow_down(real) + drift.slow_down(real, at_s) + stall.after_step()
            opt.step()
            step += 1
            if step % eval_every == 0:
                if together:
                    hvd.barrier()
                train_s += time.perf_counter() - started
                acc, loss = accuracy(model, xt, yt)
                curve.append([step / steps_per_epoch, step, train_s, acc, loss])
                if not math.isfinite(loss):
                    stop = True
                target = spec["target"]
                if spec["stop_at_target"] and target is not None and acc >= target:
                    stop = True
                if spec["max_train_s"] is not None and train_s >= spec["max_train_s"]:
                    stop = True
                # every rank has the same parameters, hence the same accuracy and the same decision
                if stop and not grouped:
                    break
                yield
                started = time.perf_counter()
        if stop and not grouped:
            break
        if together:
            hvd.barrier()
        train_s += time.perf_counter() - started
        if not curve or curve[-1][1] != step:  # the model as the epoch ends
            acc, loss = accuracy(model, xt, yt)
            curve.append([epoch + 1.0, step, train_s, acc, loss])
        if saved_at is not None and hvd.rank() == 0:
            _save(saved_at, {"epoch": epoch + 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                             "curve": curve, "train_s": train_s, "step": step})
        yield
    group_stats = aggregation.group_async_stats()
    if grouped:  # every rank now holds the one final model the groups' models mix into
        aggregation.end_group_async()
        acc, loss = accuracy(model, xt, yt)
        curve.append([curve[-1][0], step, train_s, acc, loss])
    return {
        "name": spec["name"], "spec": spec, "aggregation": aggregation.aggregation_of(opt), "curve": curve,
        "final_acc": curve[-1][3], "train_s": train_s, "steps": step, "steps_per_epoch": steps_per_epoch,
        "compute_s": compute_s, "straggler_extra_s": extra_s,
        "lbbsp": sampler.stats() if isinstance(sampler, LBBSPSampler) else None,
        "group_async": group_stats, "resumed_at_epoch": first_epoch if resumed is not None else None,
        "resumed_state": resumed["state"] if resumed is not None else None,
    }


def _save(path: Path, checkpoint: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)  # a kill while saving leaves the last whole checkpoint


def _resume(path: Path | None, model: nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    """Horovod's resume: rank 0 loads the checkpoint, then every rank takes rank 0's model and optimizer
    state. The epoch, curve and clock come back on every rank; None when there is nothing to resume."""
    record = None
    if path is not None and hvd.rank() == 0 and path.exists():
        checkpoint = torch.load(path, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        record = {key: checkpoint[key] for key in ("epoch", "curve", "train_s", "step")}
        record["state"] = checkpoint["optimizer"].get("group_async")
    record = hvd.broadcast_object(record, root_rank=0, name="resume")
    if record is not None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    return record


def _batches(specs: list[dict]) -> list[list[dict]]:
    """Consecutive specs with the same `interleave` key train together; the others one at a time."""
    batches: list[list[dict]] = []
    for spec in specs:
        key = spec["interleave"]
        if key is not None and batches and batches[-1][0]["interleave"] == key:
            batches[-1].append(spec)
        else:
            batches.append([spec])
    return batches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=["digits", "mnist1d"], default="digits")
    p.add_argument("--data", default="", help="cache file for generated MNIST-1D data")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--runs", default="[{}]", help="JSON list of run specs, or @file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pace", type=float, default=0.0, help="stretch each compute phase to K x its CPU time")
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint", default="", help="save each run at every epoch's end to DIR/NAME.pt, and "
                   "resume a run whose file is there")
    args = p.parse_args()

    raw = open(args.runs[1:]).read() if args.runs.startswith("@") else args.runs
    specs = [{**DEFAULT_RUN, **item} for item in json.loads(raw)]
    if any(spec["rule"] == "group_async" for spec in specs):
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # before hvd.init: groups are process sets
    hvd.init()
    torch.set_num_threads(args.threads)
    x, y, xt, yt = load_data(args.dataset, args.data)
    data = (torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt))
    results = []
    for batch in _batches(specs):
        for last in interleaved(batch, data, args):
            results.append(last)
            if hvd.rank() == 0:
                print(f"run {last['name']}: acc {last['final_acc']:.4f} in {last['train_s']:.1f}s "
                      f"({last['steps']} steps, {last['aggregation']})", flush=True)
        summary = {"rank": hvd.rank(), "size": hvd.size(), "dataset": args.dataset, "model": args.model,
                   "width": args.width, "train_size": len(x), "test_size": len(xt), "runs": results}
        write_rank_summary(args.out, hvd.rank(), summary)  # after every run: a later failure keeps these
    hvd.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
