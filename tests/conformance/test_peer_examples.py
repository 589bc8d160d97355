"""Conformance: Horovod 0.28.1's own PyTorch examples as two co-located jobs finish within 2x, never overlapping.

The scripts are run unmodified from `../shared/peer/horovod-0.28.1/examples/pytorch/`
(CI has `shared/` beside the checkout; nothing is copied into the project), each
rank through `with_crossover.py`, which imports `crossover.auto` first, as a user
adds it. As in `test_colocated_scripts.py`, every pair (two 2-rank jobs running
the same script) runs it once per round in the same rank processes: a warm-up,
then under `passthrough` (the baseline), `exclusive` and `crossover`, with one
rank of each job per device (`--cpu-devices 2`) and with both ranks of a job on
one device (`--cpu-devices 1`). Each round has folders of its own (`{round}` in
the flags): a job finding an earlier round's checkpoint would resume from it.
The ImageNet example's rounds are long (8-22 s blocking), so it runs one blocking
round, the daemon switched between `exclusive` and `crossover` every second, and
the event log cut at each switch shows what each policy did.

- `pytorch_imagenet_resnet50.py`: ResNet-50, a metric `hvd.allreduce` after every
  sub-batch (`Metric.update`), the resume epoch broadcast, `--batches-per-allreduce 2`
  (backward_passes_per_step), an evaluation, a checkpoint written by rank 0.
- `pytorch_mnist.py`: `metric_average` (an allreduce) after the evaluation of each
  epoch; two epochs, so it sits between training phases.
- `pytorch_synthetic_benchmark.py`: the timing loop on synthetic data.

What the environment and the CI budget force, and nothing else, differs from the
scripts' defaults:
- Data: there is no network. The ImageNet example gets a two-class ImageFolder of
  32x32 PNGs (4 train, 2 validation images; its own transforms crop them to 224x224:
  with `--batch-size 1` each rank takes one optimizer step of two backward passes);
  `pytorch_mnist.py` gets MNIST's four raw idx files in `<data-dir>/MNIST/raw/`
  (scikit-learn's bundled `load_digits`, 8x8 upscaled to 28x28: 256 train, 128 test),
  which torchvision reads without downloading. Both are made once per module.
- Size: epochs, batch sizes and iteration counts are cut so the file fits the CI
  budget on 2 cores; the synthetic benchmark runs `--model squeezenet1_1` instead of
  its default resnet50 (the ImageNet example keeps its hard-coded ResNet-50).
- `--no-cuda` everywhere: the daemon manages CPU cores here (`--cpu-devices`).
- Paths: `--log-dir`, `--checkpoint-format` and `--data-dir` point into temp folders,
  each job's and each round's its own (a job finding another's checkpoint would
  resume from it and skip training).
- torchvision's CPU ops, missing in the only build the index has: see `with_crossover.py`.

Each job must exit 0, the daemon must grant devices under `exclusive` and
`crossover`, no compute phases may overlap on a device and no holder may be
`overdue`. Wall times go to `judge.CONFORMANCE_RESULTS` (`~/.cache/crossover/conformance.json`) (pair `peer:<script>`).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from testbed.harness.jobs import Job, horovodrun
from tests.conformance.judge import (
    ALTERNATING_ROUNDS,
    PEER,
    PLACEMENTS,
    POLICY_ROUNDS,
    WITH_CROSSOVER,
    judge_rounds,
    record_conformance,
    run_pair_in_rounds,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.conformance, pytest.mark.timeout(600)]

EXAMPLES = PEER / "examples" / "pytorch"

# script -> its flags, given the module's data folder and this job's own folder
SCRIPTS: dict[str, Callable[[Path, Path], tuple[str, ...]]] = {
    "pytorch_imagenet_resnet50.py": lambda data, run: (
        "--train-dir", str(data / "imagenet" / "train"), "--val-dir", str(data / "imagenet" / "val"),
        "--log-dir", str(run / "logs-{round}"), "--checkpoint-format", str(run / "checkpoint-{round}-{epoch}.pth.tar"),
        "--epochs", "1", "--batch-size", "1", "--val-batch-size", "2", "--batches-per-allreduce", "2",
        "--no-cuda"),
    "pytorch_mnist.py": lambda data, run: (
        "--data-dir", str(data / "mnist"), "--epochs", "2", "--batch-size", "32", "--no-cuda"),
    "pytorch_synthetic_benchmark.py": lambda data, run: (
        "--model", "squeezenet1_1", "--batch-size", "2", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda"),
}


def _image_folder(root: Path, per_class: int, seed: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.png")


def _idx(path: Path, array) -> None:
    """An unsigned-byte idx file (MNIST's format): magic 0x08 with the rank, big-endian sizes, the bytes."""
    import numpy as np

    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def _mnist(root: Path, n_train: int, n_test: int) -> None:
    import numpy as np

    from testbed.workloads.digits import load_digits

    pixels, target = load_digits()
    images = np.kron(pixels.reshape(-1, 8, 8) / 16.0 * 255.0, np.ones((3, 3))).round().astype(np.uint8)  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))  # 28x28, centred like MNIST
    labels = target.astype(np.uint8)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, sl in (("train", slice(0, n_train)), ("t10k", slice(n_train, n_train + n_test))):
        _idx(raw / f"{prefix}-images-idx3-ubyte", images[sl])
        _idx(raw / f"{prefix}-labels-idx1-ubyte", labels[sl])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    if not EXAMPLES.is_dir():
        pytest.fail(f"{EXAMPLES} is missing: CI and `make test` need ../shared beside the checkout")
    if importlib.util.find_spec("torchvision") is None:
        # scripts/bootstrap.sh installs it only for a torch it knows the matching version of.
        (pytest.fail if os.environ.get("CROSSOVER_TEST_STRICT") == "1" else pytest.skip)(
            "torchvision is not installed: Horovod's examples need it (see scripts/bootstrap.sh)")
    root = tmp_path_factory.mktemp("peer-data")
    _image_folder(root / "imagenet" / "train", per_class=2, seed=0)
    _image_folder(root / "imagenet" / "val", per_class=1, seed=1)
    _mnist(root / "mnist", n_train=256, n_test=128)
    return root


# The ImageNet example's round is ResNet-50's compute: its first run pays nothing a warm-up would take off
# (measured: a warm-up round no longer than the baseline's), so it starts with the baseline.
_WARM_UP = {"pytorch_imagenet_resnet50.py": False}
# Its blocking rounds last 8-22 s: one round serves both policies, switched every second (judge.ALTERNATING).
_BLOCKING = {"pytorch_imagenet_resnet50.py": ALTERNATING_ROUNDS}


def _run_pairs(daemon_factory, jobs, data: Path, tmp: Path, script: str, devices: str) -> tuple[dict[str, float], list]:
    def start(name: str, round_flags: tuple[str, ...], env: dict[str, str]) -> Job:
        run = tmp / name
        run.mkdir()
        return horovodrun(name, WITH_CROSSOVER, tmp, np=2, out_flag=False, cwd=run, env=env,
                          args=(*round_flags, str(EXAMPLES / script), *SCRIPTS[script](data, run)))

    return run_pair_in_rounds(daemon_factory, jobs, tmp, devices, script, start, warm_up=_WARM_UP.get(script, True),
                              blocking=_BLOCKING.get(script, POLICY_ROUNDS))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_peer_example_pair_finishes_without_overlap(daemon_factory, jobs, data, tmp_path, script, placement):
    row: dict[str, float | int | str] = {"pair": f"peer:{os.path.splitext(script)[0]}", "placement": placement}
    walls, events = _run_pairs(daemon_factory, jobs, data, tmp_path, script, PLACEMENTS[placement])
    judge_rounds(f"{script} on {placement}", placement, walls, events, row)
    record_conformance(row)
