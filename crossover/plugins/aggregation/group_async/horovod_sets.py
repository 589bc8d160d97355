"""What group_async asks of Horovod beyond collectives: the groups' process sets, added and removed by
every rank together, and a shutdown that waits until this rank's groups have finished."""
from __future__ import annotations

import atexit
from typing import Any, Callable

from crossover.plugins.aggregation.group_async.grouping import Groups

__all__ = ["ProcessSets", "hold_shutdown"]


class ProcessSets:
    """Horovod process sets by their ranks, until group_async training ends: Horovod refuses to add one twice,
    so one registry serves every runtime of the process."""

    _sets: dict[tuple[int, ...], Any] = {}

    def __init__(self, hvd: Any, world: int) -> None:
        self.hvd = hvd
        self.world = world

    def of(self, ranks: tuple[int, ...]) -> Any:
        """The process set of a group (the global one for a group of every rank)."""
        if len(ranks) == self.world:
            return self.hvd.global_process_set
        return self._sets[ranks]

    def ensure(self, groups: Groups) -> None:
        """Process sets are added by every rank together (Horovod's rule), so only at boundaries."""
        for ranks in groups:
            if len(ranks) < self.world and ranks not in self._sets:
                self._sets[ranks] = self.hvd.add_process_set(list(ranks))

    def remove_all(self) -> None:
        """Every rank removes the groups' process sets together: Horovod's background loop serves each
        set at every cycle, so sets left behind would slow whatever the script trains next."""
        for ranks in list(self._sets):
            self.hvd.remove_process_set(self._sets.pop(ranks))


def hold_shutdown(hvd: Any, owner: object, finish: Callable[[], None]) -> None:
    """Groups end training at different moments, and Horovod's shutdown (an explicit ``hvd.shutdown()``
    or its own at exit) stops every rank: both call `finish` first. `owner` marks the wrapper, so a
    second runtime wraps Horovod's own shutdown, not the first one's wrapper."""
    original = hvd.shutdown
    if getattr(original, "_crossover_runtime", None) is not None:
        original = original._crossover_original

    def shutdown() -> None:
        try:
            finish()
        finally:
            original()

    shutdown._crossover_runtime = owner  # type: ignore[attr-defined]
    shutdown._crossover_original = original  # type: ignore[attr-defined]
    hvd.shutdown = shutdown
    atexit.register(finish)
