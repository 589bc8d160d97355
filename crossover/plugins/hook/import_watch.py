"""Run a callback once a module has been imported, whenever that happens: the one import stays light.

`import crossover.auto` comes before the script imports its framework. Rather than
importing Horovod or torch itself (which would load Horovod's Gloo into a DDP job,
and everything into a disabled one), it asks to be told when the script imports
them (`when_imported`): a finder first in `sys.meta_path` lets the normal finders
locate the module and wraps its loader, so the callback runs right after the
module's own code, before the `import` statement returns to the script.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

_log = logging.getLogger(__name__)

_FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
                 importlib.machinery.ExtensionFileLoader)
_lock = threading.Lock()
_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported: now if it already is, else right after its import.

    A callback's error is logged, never raised into the script's import.
    """
    module = sys.modules.get(name)
    if module is not None:
        _run(callback, module)
        return
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if not any(isinstance(f, _Watcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _Watcher())


def _run(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:
        _log.exception("crossover could not hook %s; the script runs unscheduled", module.__name__)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it asks the other finders and wraps what they found.

    The found loader keeps its class (code that inspects loaders sees the real one); only its instance's
    ``exec_module`` is wrapped, and file finders make a loader per module, so no other module shares it.
    """

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if isinstance(loader, _FILE_LOADERS):  # one per module: safe to wrap
                try:
                    loader.exec_module = _after(loader.exec_module, fullname)  # type: ignore[method-assign,assignment]
                except (AttributeError, TypeError):
                    _log.info("crossover cannot watch the import of %s; it is not hooked", fullname)
            else:
                _log.info("crossover cannot watch the import of %s (loaded by %r); it is not hooked", fullname,
                          loader)
            return spec
        return None


def _after(exec_module: Callable[[ModuleType], None], name: str) -> Callable[[ModuleType], None]:
    """The loader's ``exec_module``, then the callbacks waiting for ``name``."""
    def run(module: ModuleType) -> None:
        exec_module(module)
        with _lock:
            callbacks = _waiting.pop(name, [])
            if not _waiting:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]
        for callback in callbacks:
            _run(callback, module)

    return run
