"""One Horovod rank that counts the plugin's work per iteration (run with `import crossover.auto` first).

It trains an MLP of `--tensors` parameter tensors through Horovod's own DistributedOptimizer, waits until its
session is in `--state` (a lease, or the daemon's word that a higher class shares its device), and then counts,
on the training thread and over `--iters` iterations, every call into the product's code (`crossover/`) and
every frame that thread sends on the session's stream, and the yields it made (an outranked rank hands its device
back whenever the higher class asks). It writes them, per iteration, to `--out`/countsRANK.json.
`tests/multiprocess/test_hot_path_counts.py` runs it in each state against a real crossoverd.
"""

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import horovod.torch as hvd
import torch

import crossover
from crossover.plugins.hook.runtime import RUNTIME

_PRODUCT = str(Path(crossover.__file__).parent)


def _model(tensors: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 8)]
    for _ in range(tensors // 2 - 1):
        layers += [torch.nn.ReLU(), torch.nn.Linear(8, 8)]
    return torch.nn.Sequential(*layers)


def _in_state(state: str) -> bool:
    session = RUNTIME.session
    if session is None or not session.attached:
        return False
    return {"leased": lambda: session._leased, "outranked": lambda: session.outranked,
            "granted": lambda: not session._leased and not session.outranked}.get(state, lambda: True)()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--state", choices=["passthrough", "leased", "granted", "outranked"], required=True)
    p.add_argument("--tensors", type=int, default=160)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--state-timeout", type=float, default=30.0)
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = _model(args.tensors)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    x = torch.ones(4, 8)

    def iterate(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    iterate(args.warmup)
    deadline = time.monotonic() + args.state_timeout
    while not _in_state(args.state):
        if time.monotonic() > deadline:
            raise SystemExit(f"the rank never got into state {args.state}")
        iterate(1)
    iterate(2)  # the hook chain follows a new state at the next step

    session = RUNTIME.session
    assert session is not None and session._stream is not None
    stream, counts, frames, trainer = session._stream, Counter[str](), [0], threading.get_ident()
    send = stream.send

    def counting_send(event: Any) -> None:
        frames[0] += threading.get_ident() == trainer
        send(event)

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_PRODUCT):
            code = frame.f_code
            counts[f"{Path(code.co_filename).stem}.{code.co_qualname}"] += 1

    phases = RUNTIME.phases
    assert phases is not None
    yields = phases.yields
    stream.send = counting_send  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        iterate(args.iters)
    finally:
        sys.setprofile(None)
        stream.send = send  # type: ignore[method-assign]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"counts{hvd.rank()}.json").write_text(json.dumps({
        "state": args.state, "tensors": args.tensors, "iters": args.iters,
        "calls": {name: n / args.iters for name, n in counts.items()}, "frames": frames[0] / args.iters,
        "yields": (phases.yields - yields) / args.iters}))


if __name__ == "__main__":
    main()
