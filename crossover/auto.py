"""`import crossover.auto` as a script's first line schedules it through crossoverd.

Importing this module hooks `horovod.torch.DistributedOptimizer`; nothing
else changes in the script. `crossover.auto.waiting()` is the one call a
script may add: around a wait outside Horovod (a file, a queue, a service),
it frees the device for the wait's length. `crossover.auto.use_device(turns)`
hands turns over on a device the plugin does not know itself (CUDA GPUs it
does). Settings come from `CROSSOVER_*` variables (see
the README table); without a daemon the import is a quiet no-op apart from
one warning.
"""
import logging as _logging
import os as _os

from crossover.plugins.hook import horovod_torch as _hook
from crossover.plugins.hook.horovod_torch import use_device, waiting
from crossover.plugins.hook.settings import PluginSettings as _PluginSettings
from crossover.plugins.hook.settings import SettingError as _SettingError

__all__ = ["use_device", "waiting"]

_logger = _logging.getLogger("crossover")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter(f"[crossover pid {_os.getpid()}] %(levelname)s %(message)s"))
    _logger.addHandler(_handler)
    _logger.propagate = False

try:
    _settings = _PluginSettings.from_env(_hook._script_name())
    _logger.setLevel(_settings.log_level if _settings.log_level in _logging._nameToLevel else "WARNING")
    _hook.install(_settings)
except _SettingError as _exc:
    _logger.error("%s; crossover is disabled for this run", _exc)
