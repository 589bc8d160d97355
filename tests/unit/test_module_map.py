"""docs/architecture.md's module map lists every product module with its docstring's first sentence."""
from __future__ import annotations

from scripts.gen_module_map import DOC, first_sentence, modules, render


def test_the_module_map_is_current() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert render(text) == text, "docs/architecture.md's module map is stale: run `python -m scripts.gen_module_map`"


def test_every_product_module_says_what_it_is() -> None:
    missing = [str(p) for p in modules() if first_sentence(p) == "(no docstring)"]
    assert not missing, f"modules without a docstring: {missing}"
