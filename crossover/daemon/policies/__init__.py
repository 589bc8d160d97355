"""Grant policies. Each is a pure class implementing `crossover.daemon.api.Policy`."""
from __future__ import annotations

from typing import Callable

from crossover.daemon.api import NotFound, Policy
from crossover.daemon.policies.classes import ClassSettings
from crossover.daemon.policies.crossover import CrossoverPolicy, CrossoverSettings
from crossover.daemon.policies.exclusive import ExclusivePolicy
from crossover.daemon.policies.passthrough import PassthroughPolicy

__all__ = ["available", "create", "CrossoverPolicy", "CrossoverSettings", "ExclusivePolicy", "PassthroughPolicy"]

_FACTORIES: dict[str, Callable[[], Policy]] = {
    "passthrough": PassthroughPolicy,
    "exclusive": ExclusivePolicy,
    "crossover": CrossoverPolicy,
}


def available() -> list[str]:
    """Names accepted by `create`, `crossoverd --policy` and `crossover policy NAME`."""
    return sorted(_FACTORIES)


def create(name: str, classes: ClassSettings | None = None, wall_offset: float = 0.0) -> Policy:
    """A fresh policy instance by name; `NotFound` names the valid choices. `classes`: the class rules'
    settings, for the policy that has them (`crossover`); `wall_offset`: the wall clock minus the clock
    its `now` comes from, so that its isolation windows align on every node."""
    if name not in _FACTORIES:
        raise NotFound(f"unknown policy {name!r}; choose one of: {', '.join(available())}")
    if name == "crossover":
        return CrossoverPolicy(classes=classes, wall_offset=wall_offset)
    return _FACTORIES[name]()
