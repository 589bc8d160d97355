"""Rewrite docs/settings.md's table from the settings' declarations (crossover.settings.PLUGIN_SETTINGS).

Usage: python -m scripts.gen_settings_table   (tests/unit/test_readme.py fails while they differ)
"""
from __future__ import annotations

from pathlib import Path

from crossover.settings import PLUGIN_SETTINGS

TABLE_DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
_BEGIN = "<!-- settings-table"
_END = "<!-- /settings-table -->"


def table() -> str:
    rows = [f"| `{name}` | {s.default_text()} | {s.meaning} |" for name, s in PLUGIN_SETTINGS.items()]
    return "\n".join(["| variable | default | meaning |", "| --- | --- | --- |", *rows])


def main() -> None:
    text = TABLE_DOC.read_text()
    head, rest = text.split(_BEGIN, 1)
    marker, _old = rest.split("\n", 1)
    _, tail = rest.split(_END, 1)
    TABLE_DOC.write_text(f"{head}{_BEGIN}{marker}\n{table()}\n{_END}{tail}")


if __name__ == "__main__":
    main()
