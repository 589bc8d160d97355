"""torchvision beside the CPU build of torch that this machine installs.

PyPI has no CPU build of torchvision, and the CUDA build's compiled ops do not
load beside a CPU torch. torchvision's Python parts (datasets, transforms,
models) need none of them, but its import registers fake kernels for two ops
(`nms`, `qnms`) that then do not exist. When that import fails, this declares
those two schemas, with no kernel, and imports again; nothing else changes.
Beside a CUDA torch (a GPU machine) the first import succeeds.
"""
from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["import_torchvision"]

_keep: list = []


def import_torchvision() -> ModuleType:
    """`import torchvision`, declaring its two missing op schemas first where the import needs them."""
    try:
        import torchvision
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
        import torchvision
    return torchvision
