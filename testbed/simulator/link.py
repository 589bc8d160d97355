"""`crossover-link`: `crossover` with allreduces kept apart on each device's link (the simulator's variant).

Concurrent allreduces through one device's link share it, and a job's allreduce
runs at the pace of its most shared link, so two allreduces that overlap both end
late. When the rank `crossover` chose would end its compute while allreduces that
already left this device still run, a waiting rank whose allreduce would overlap
them at least `link_gap_s` less goes first (typically a longer compute that ends
after the link is free). All of it is this node's own measure: a rank in its
allreduce is expected off the link at its release + its allreduce as this node saw
it (EMA, peer waits included); a candidate's overlap is that moment - now - its
compute EMA, at most its own allreduce. The rule acts only when the rank chosen and
the rank that would pass it both belong to jobs of at most `link_ranks` ranks (a wider
job queued between them can still be passed). A pass counts against `max_overtakes`
like any other.

On the simulator it reaches the offline reference's orders on the heterogeneous
scenarios; on the device-model bed, with real daemons, it ran a short job 1.5-1.8x
slower and lost 8-10 % of iterations/s to `exclusive`, which the simulator does not
reproduce even with skewed nodes (docs/policies.md, "crossover-link"). So the daemon
does not carry it.
"""
from __future__ import annotations

from dataclasses import dataclass

from crossover.daemon.api import RankKey
from crossover.daemon.policies import CrossoverPolicy, CrossoverSettings
from crossover.daemon.policies._queues import _Device

__all__ = ["LinkPolicy", "LinkSettings"]


@dataclass(frozen=True)
class LinkSettings:
    """`link_ranks`: the rule acts only between jobs of at most this many ranks; `link_gap_s`: by how much less
    a passing rank's allreduce must overlap (a job's phases measured on two nodes differ by a few ms);
    `max_overtakes`: how often one request may be passed over, by a shorter job or by the link rule."""

    link_ranks: int = 8
    link_gap_s: float = 0.005
    max_overtakes: int = 3

    def __post_init__(self) -> None:
        if self.link_ranks < 1:
            raise ValueError(f"link_ranks {self.link_ranks}: must be >= 1")
        if self.link_gap_s < 0:
            raise ValueError(f"link_gap_s {self.link_gap_s}: must be >= 0")


class LinkPolicy(CrossoverPolicy):
    """`crossover`, and a rank whose allreduce would overlap less with those still on the link goes first."""

    name = "crossover-link"

    def __init__(self, settings: LinkSettings | None = None) -> None:
        self.link = settings or LinkSettings()
        super().__init__(CrossoverSettings(max_overtakes=self.link.max_overtakes))
        self._comm: dict[RankKey, float] = {}  # rank -> EMA of its allreduces as it saw them (with peer waits)
        self._released: dict[RankKey, float] = {}  # rank in its allreduce -> when it released its device
        self._now = 0.0  # the latest event's time: what the rule measures from
        self._linked = False  # whether the last `_refine` passed its choice over
        self.link_passes = 0

    def decisions(self) -> dict[str, int]:
        return {**super().decisions(), "link": self.link_passes}

    def leave(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        self._comm.pop(key, None)
        self._released.pop(key, None)
        return super().leave(key, now)

    def cancel(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        return super().cancel(key, now)

    def request(self, key: RankKey, iteration: int, now: float) -> list[RankKey]:
        self._now = now
        self._released.pop(key, None)  # its allreduce has ended
        return super().request(key, iteration, now)

    def release(self, key: RankKey, now: float) -> list[RankKey]:
        self._now = now
        if key in self._q.ranks and self.holds(key):
            self._released[key] = now  # its allreduce begins on this device's link (after its peers)
        return super().release(key, now)

    def observe(self, key: RankKey, phase: str, duration_s: float, now: float) -> None:
        if phase == "comm" and duration_s > 0 and key in self._q.ranks:
            a, old = self.settings.ema_alpha, self._comm.get(key)
            self._comm[key] = duration_s if old is None else (1 - a) * old + a * duration_s
        super().observe(key, phase, duration_s, now)

    def _refine(self, by_time: list[RankKey], chosen: RankKey) -> RankKey:
        """`chosen`, or the waiting rank whose allreduce would overlap least with the allreduces already on
        the device's link, if that is at least `link_gap_s` less than `chosen`'s."""
        small = self.link.link_ranks
        ranks = self._q.ranks
        if ranks[chosen].world_size > small:
            return chosen
        device = ranks[chosen].device
        ends = [t + self._comm.get(k, 0.0) for k, t in self._released.items() if ranks[k].device == device]
        if not ends:
            return chosen
        free_in = max(ends) - self._now  # until the link is expected free

        def overlap(k: RankKey) -> float | None:  # how long k's allreduce would share the link, if served now
            c = self._compute.get(k.job_id)
            return None if c is None else min(max(0.0, free_in - c), self._comm.get(k, free_in))

        chosen_o = overlap(chosen)
        if chosen_o is None:
            return chosen
        best, best_o = chosen, chosen_o - self.link.link_gap_s  # only a clearly shorter overlap passes
        for k in by_time:  # request order: the earliest among equals
            o = overlap(k)
            if o is not None and o < best_o and ranks[k].world_size <= small:
                best, best_o = k, o
        self._linked = best != chosen
        return best

    def _dispatch(self, dev: _Device) -> list[RankKey]:
        self._linked = False
        granted = super()._dispatch(dev)
        if self._linked:
            self.link_passes += 1
        return granted
