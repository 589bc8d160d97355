"""Which aggregation rule new optimizers get: ``CROSSOVER_AGGREGATION`` or :func:`set_aggregation` (which wins).

Without either, nothing changes: Horovod does what the script asked for. The environment is read once
per process: the rules follow the plugin's read (``PluginSettings.aggregation``, which the Horovod hook
keeps) or, in a script that builds its optimizers without the hook, this module's own, made at first
use. :func:`use_settings` puts other settings in their place.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Optional

from crossover.errors import CrossoverError
from crossover.plugins.aggregation.process_state import STATE
from crossover.plugins.hook.runtime import RUNTIME
from crossover.settings import ADASUM_ALGORITHMS, ADASUM_IMPLS, AGGREGATION_RULES, AggregationSettings, SettingError

__all__ = ["AggregationError", "Rule", "current_rule", "prepare_horovod", "set_aggregation", "settings",
           "use_settings"]

Rule = Literal["average", "sum", "adasum", "weighted", "group_async"]


class AggregationError(CrossoverError, ValueError):
    """The requested aggregation cannot be applied as asked (the message says why and what to do)."""


def set_aggregation(
    rule: Optional[str], *, adasum_impl: Optional[str] = None, adasum_algorithm: Optional[str] = None
) -> None:
    """Select the aggregation rule in code; it wins over ``CROSSOVER_AGGREGATION``.

    Affects optimizers built afterwards. ``rule=None`` goes back to the
    environment (and so, by default, to Horovod's own behaviour).
    ``adasum_impl`` (``auto|native|plugin``) and ``adasum_algorithm``
    (``auto|allgather|recursive_doubling``) override their variables likewise.
    """
    if rule is not None and rule not in AGGREGATION_RULES:
        raise AggregationError(f"unknown aggregation rule {rule!r}; use one of {', '.join(AGGREGATION_RULES)}")
    if adasum_impl is not None and adasum_impl not in ADASUM_IMPLS:
        raise AggregationError(f"unknown adasum_impl {adasum_impl!r}; use one of {', '.join(ADASUM_IMPLS)}")
    if adasum_algorithm is not None and adasum_algorithm not in ADASUM_ALGORITHMS:
        raise AggregationError(
            f"unknown adasum_algorithm {adasum_algorithm!r}; use one of {', '.join(ADASUM_ALGORITHMS)}"
        )
    STATE.selected.update(rule=rule, adasum_impl=adasum_impl, adasum_algorithm=adasum_algorithm)


def use_settings(chosen: Optional[AggregationSettings]) -> None:
    """Follow `chosen` in place of the environment's settings (a workload that trains several configurations
    in one process); ``None`` goes back to the environment's: the Horovod hook's read where it is installed,
    else read afresh at the next use."""
    STATE.given = chosen
    STATE.read = None


def _environment() -> AggregationSettings:
    """:func:`use_settings`'s, else the Horovod hook's read, else this module's own (made once)."""
    if STATE.given is not None:
        return STATE.given
    if RUNTIME.settings is not None:
        return RUNTIME.settings.aggregation
    if STATE.read is None:
        STATE.read = AggregationSettings.from_env()
    return STATE.read


def settings() -> AggregationSettings:
    """The environment's settings with the in-code selection applied on top."""
    env = _environment()
    changes: dict[str, Any] = {key: value for key, value in STATE.selected.items() if value is not None}
    return dataclasses.replace(env, **changes) if changes else env


def current_rule() -> Optional[str]:
    """The rule new optimizers get, or ``None`` for Horovod's own behaviour."""
    return settings().rule or None



def prepare_horovod() -> None:
    """Before ``hvd.init()``: ``group_async`` re-forms Horovod process sets at epoch boundaries, which
    Horovod allows only with dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1``); set it unless
    the environment says otherwise. A bad setting is left for the rules to report where they are used."""
    try:
        rule = settings().rule
    except SettingError:
        return
    if rule == "group_async":
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
