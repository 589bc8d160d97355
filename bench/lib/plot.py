"""Plotting for benchmarks: matplotlib without a display, figures written as PNG files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save"]


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (files only, no display); imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (PNG at 110 dpi, creating the folder) and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
