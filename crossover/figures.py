"""How figures are summed up and written, once for the daemon, the CLI, the plugin and the benchmarks:
a percentile (by nearest rank) and sizes in bytes (read from a flag, written for a person)."""
from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_bytes", "parse_size", "percentile"]


def percentile(xs: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) by nearest rank: always one of the values, never between two; NaN for
    no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000 ** 2,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1000 ** 3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000 ** 4,
          "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(%|[A-Za-z]*)\s*$")


def parse_size(text: str) -> tuple[float, int]:
    """`"50%"` → (0.5, 0); `"40GiB"`, `"40G"`, `"512MiB"`, `"1.5GB"`, `"1073741824"` → (0, bytes).
    ValueError says what is wrong."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(f"size {text!r}: write a share of the device (50%) or an amount (40GiB, 512MiB)")
    value = float(m.group(1))
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"size {text!r}: a share must be above 0% and at most 100%")
        return value / 100, 0
    amount = int(value * _UNITS[unit])
    if amount <= 0:
        raise ValueError(f"size {text!r} is no memory at all")
    return 0.0, amount


def format_bytes(n: int) -> str:
    """`42.5 GiB`, `512 MiB`: the unit that keeps the figure between 1 and 1024."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"
