"""Run someone else's script with `import crossover.auto` as its first line, without copying it.

    python with_crossover.py SCRIPT [ARGS ...]     # a script, as `python SCRIPT ARGS`
    python with_crossover.py -m MODULE [ARGS ...]  # a module, as `python -m MODULE ARGS`

The conformance tier launches Horovod's own examples and test suite from
`../shared/peer/` this way under `horovodrun`. One thing the machine forces:
PyPI has no CPU build of torchvision, and the CUDA build's compiled ops do not
load beside a CPU torch. torchvision's Python parts (datasets, transforms,
models) need none of them, but its import registers fake kernels for two ops
(`nms`, `qnms`) that then do not exist. When that import fails, this declares
those two schemas, with no kernel, and imports again; nothing else changes.
"""
from __future__ import annotations

import runpy
import sys

import crossover.auto  # noqa: F401  (first, as a user adds it)


def _import_torchvision() -> None:
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        return
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        import torch

        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _keep.append(lib)
        import torchvision  # noqa: F401,F811


_keep: list = []


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    _import_torchvision()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
