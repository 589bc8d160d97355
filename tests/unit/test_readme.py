"""docs/settings.md's table is the code's (every variable documented, nothing stale), and the README, the front
page, stays short and names no variable the code does not read."""
import re
from pathlib import Path

from crossover.settings import PLUGIN_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SETTINGS = ROOT / "docs" / "settings.md"


def _table() -> dict[str, str]:
    text = SETTINGS.read_text()
    block = text.split("<!-- settings-table", 1)[1].split("<!-- /settings-table -->", 1)[0]
    rows = re.findall(r"^\| `(CROSSOVER_[A-Z_]+)` \| ([^|]*) \|", block, flags=re.M)
    return {name: default.strip() for name, default in rows}


def test_every_setting_is_in_the_settings_table_with_its_default():
    table = _table()
    assert set(table) == set(PLUGIN_SETTINGS), "docs/settings.md's table and PLUGIN_SETTINGS differ"
    for name, setting in PLUGIN_SETTINGS.items():
        default = setting.default_text()
        assert table[name] == default, f"{name}: docs/settings.md says {table[name]!r}, code says {default!r}"


def test_the_front_page_is_short():
    assert len(README.read_text().splitlines()) <= 150, "README.md is the front page: at most 150 lines"


def test_readme_names_no_unknown_crossover_variable():
    mentioned = set(re.findall(r"\b(CROSSOVER_[A-Z_]+)\b", README.read_text() + SETTINGS.read_text()))
    allowed = set(PLUGIN_SETTINGS) | {"CROSSOVER_WHEEL_CACHE", "CROSSOVER_VENV"}
    assert mentioned <= allowed, f"README mentions undefined settings: {sorted(mentioned - allowed)}"
