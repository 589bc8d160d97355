"""results/ holds only figures the docs cite: each tracked file is named in the README, docs/ or SECURITY.md, by its
name or a brace list (`results/x_{a,b}.json`), and none carries a path of the machine that made it. A glob or a
folder (`results/*.json`, `results/gpu/`) describes; it cites nothing, so a new file no doc names fails here."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_CITED = re.compile(r"results/[A-Za-z0-9_./{},*?-]+")
_MACHINE_PATHS = (b"/tmp/", b"/work/", b"/home/", b"/root/")


def _expand(pattern: str) -> list[str]:
    """`a{0,1}b` and `a{0..3}b` as the shell expands them (one brace group at a time)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    parts = [str(i) for i in range(int(span.group(1)), int(span.group(2)) + 1)] if span else body.split(",")
    return [x for p in parts for x in _expand(pattern[:m.start()] + p + pattern[m.end():])]


def _citations() -> list[str]:
    texts = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {c.rstrip(".,)") for t in texts for c in _CITED.findall(t.read_text())}
    return [x for c in found for x in _expand(c) if not any(ch in x for ch in "*?") and not x.endswith("/")]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


def test_a_glob_or_a_folder_cites_nothing(tmp_path, monkeypatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("see `results/*.json`, `results/gpu/` and `results/a_{1,2}.json`")
    (tmp_path / "SECURITY.md").write_text("")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert sorted(_citations()) == ["results/a_1.json", "results/a_2.json"]


def test_brace_patterns_expand_as_the_shell_does() -> None:
    assert _expand("results/s_seed{0..2}.json") == [f"results/s_seed{i}.json" for i in range(3)]
    assert _expand("results/{a,b}_{1,2}.png") == ["results/a_1.png", "results/a_2.png", "results/b_1.png",
                                                 "results/b_2.png"]


def test_every_tracked_result_is_cited() -> None:
    cites = _citations()
    cited = set(cites)
    uncited = [f for f in _tracked() if f not in cited]
    assert not uncited, f"results files no doc cites (cite them where their figures are, or remove them): {uncited}"


def test_no_result_carries_a_path_of_the_machine_that_made_it() -> None:
    bad = [f for f in _tracked() if f.endswith((".json", ".log", ".txt"))
           and any(p in (ROOT / f).read_bytes() for p in _MACHINE_PATHS)]
    assert not bad, f"results files with a machine's paths in them (write paths relative to the checkout): {bad}"
