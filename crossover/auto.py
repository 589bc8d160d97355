"""`import crossover.auto` as a script's first line schedules it through crossoverd.

It hooks the script's framework when the script imports it: Horovod's
`DistributedOptimizer` (`horovod.torch`), or PyTorch's `DistributedDataParallel`
(a `torchrun` job). Nothing else changes in the script, and nothing of a framework
the script does not import is loaded. `crossover.auto.waiting()` is the one call a
script may add: around a wait outside its framework (a file, a queue, a service),
it frees the device for the wait's length. Settings come from `CROSSOVER_*` variables (docs/settings.md); with
`CROSSOVER_DISABLE=1` the import loads nothing more, and without a daemon it is a
quiet no-op apart from one warning.
"""
import logging as _logging
import os as _os
from typing import TYPE_CHECKING
from typing import Any as _Any

from crossover.settings import PluginSettings as _PluginSettings
from crossover.settings import SettingError as _SettingError
from crossover.settings import script_name as _script_name

if TYPE_CHECKING:
    from crossover.plugins.hook.rank_session import waiting

__all__ = ["waiting"]

_logger = _logging.getLogger("crossover")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter(f"[crossover pid {_os.getpid()}] %(levelname)s %(message)s"))
    _logger.addHandler(_handler)
    _logger.propagate = False


def _hook_front_ends(settings: _PluginSettings) -> None:
    """Hook each framework as the script imports it (at once where it already has)."""
    from crossover.plugins.hook.import_watch import when_imported

    def horovod(_module: _Any) -> None:  # before the script's `hvd.init()`: see `prepare_horovod`
        from crossover.plugins.hook import horovod_torch

        horovod_torch.install(settings)

    def ddp(module: _Any) -> None:
        from crossover.plugins.hook import ddp_torch

        ddp_torch.install(settings, module)

    def fsdp(module: _Any) -> None:
        from crossover.plugins.hook import ddp_torch

        ddp_torch.notice_fsdp(module)

    when_imported("horovod.torch", horovod)
    when_imported("torch.nn.parallel.distributed", ddp)
    when_imported("torch.distributed.fsdp", fsdp)


def __getattr__(name: str) -> _Any:
    """`waiting`, loaded on first use: a disabled import loads nothing."""
    if name in __all__:
        from crossover.plugins.hook import rank_session

        return getattr(rank_session, name)
    raise AttributeError(f"module 'crossover.auto' has no attribute {name!r}")


try:
    _settings = _PluginSettings.from_env(_script_name())
    _logger.setLevel(_settings.log_level if _settings.log_level in _logging._nameToLevel else "WARNING")
    if _settings.disabled:
        _logger.info("CROSSOVER_DISABLE is set: the import does nothing")
    else:
        _hook_front_ends(_settings)
except _SettingError as _exc:
    _logger.error("%s; crossover is disabled for this run", _exc)
