"""`when_imported`: a callback right after a module's own code, before the script's import returns."""
from __future__ import annotations

import sys
import textwrap

from crossover.plugins.hook.import_watch import _Watcher, when_imported


def test_the_callback_runs_after_the_module_and_before_the_import_returns(tmp_path, monkeypatch):
    (tmp_path / "xo_watched_pkg").mkdir()
    (tmp_path / "xo_watched_pkg" / "__init__.py").write_text("")
    (tmp_path / "xo_watched_pkg" / "inner.py").write_text(textwrap.dedent("""
        VALUE = 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[tuple[str, int]] = []
    when_imported("xo_watched_pkg.inner", lambda m: seen.append((m.__name__, m.VALUE)))
    assert seen == [] and any(isinstance(f, _Watcher) for f in sys.meta_path)
    try:
        import xo_watched_pkg.inner as inner  # noqa: F401
        assert seen == [("xo_watched_pkg.inner", 1)]
        assert type(inner.__loader__).__name__ == "SourceFileLoader"  # the real loader, not a wrapper
        assert not any(isinstance(f, _Watcher) for f in sys.meta_path), "the finder stays once nothing waits"
    finally:
        for name in ("xo_watched_pkg.inner", "xo_watched_pkg"):
            sys.modules.pop(name, None)


def test_an_imported_module_is_handed_over_at_once_and_a_failing_callback_never_raises(caplog):
    seen: list[str] = []
    when_imported("json", lambda m: seen.append(m.__name__))
    assert seen == ["json"]
    when_imported("json", lambda m: 1 / 0)
    assert "could not hook json" in caplog.text
