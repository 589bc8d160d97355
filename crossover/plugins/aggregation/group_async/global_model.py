"""The parameter service's state: the global model, its version, the groups' SSP clocks and epoch counts,
and the stage of a staged schedule, which it switches from the progress it sees (`schedule`).

Every exchange adds the group's update to the global model, ticks the group's SSP clock (`clock`), and
answers once the group is within the staleness bound of the slowest active group. With a state
directory, the model, its version, the clocks and the last applied exchange of every group are
written (atomically) before the answer, so a restarted service resumes from the newest model and loses
no acknowledged update; an exchange a leader retries after losing the answer is recognised by its
sequence number and not applied twice. The model lives there in two memory-mapped files used in turn
(the add writes the spare, then the small JSON record names it). The TCP server around it is `service`.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import numpy as np

from crossover.figures import percentile
from crossover.plugins.aggregation.group_async.clock import SSPClock
from crossover.plugins.aggregation.group_async.passes import Passes
from crossover.plugins.aggregation.group_async.schedule import Schedule
from crossover.plugins.aggregation.group_async.wire import node_identity

__all__ = ["GlobalModel"]

_log = logging.getLogger(__name__)


class GlobalModel:
    """The global model, its version, the SSP clocks and what the service has measured; thread-safe."""

    def __init__(self, bound: int, state_dir: Path | None = None, silent_after_s: float = 30.0,
                 wait_limit_s: float = 120.0, start_version: int = 0, schedule: Optional[Schedule] = None,
                 passes: Optional[Passes] = None) -> None:
        self.passes = passes if passes is not None else Passes()  # the threads the model's adds and copies use
        self.schedule = schedule if schedule is not None else Schedule("fixed", 0.5, bound)
        self.clock = SSPClock(self.schedule.stage.bound)
        self._mark: np.ndarray | None = None  # the global model at the start of the schedule's current window
        self._mark_t = 0.0
        self.switches: list[dict[str, Any]] = []  # the staged schedule's switches: when, and at what rate
        self.state_dir = state_dir
        self.silent_after_s = silent_after_s
        self.wait_limit_s = wait_limit_s
        self.model: np.ndarray | None = None
        self.version = start_version  # a run resumed from a checkpoint counts on; a saved state wins
        self.start_version = start_version
        self.last_seq: dict[int, int] = {}
        self.last_seen: dict[int, float] = {}
        self.gaps: Counter[int] = Counter()
        self.waits_s: list[float] = []
        self.taken: dict[int, dict[int, int]] = {}  # samples taken by epoch and group (running totals)
        self.resumed_from: int | None = None
        self._current = self._FILES[0]
        self._spare: np.ndarray | None = None
        self._cond = threading.Condition()
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    # ---- persistence ---------------------------------------------------

    _FILES = ("model-a.f32", "model-b.f32")

    def _mapped(self, name: str, numel: int) -> np.ndarray:
        assert self.state_dir is not None
        path = self.state_dir / name
        with open(path, "a+b") as f:
            if os.fstat(f.fileno()).st_size != numel * 4:
                f.truncate(numel * 4)
            mm = mmap.mmap(f.fileno(), max(1, numel * 4))
        return np.frombuffer(mm, dtype=np.float32, count=numel)

    def _keep(self, current: str, numel: int, model: Optional[np.ndarray] = None) -> None:
        """Hold the model in the state directory's file ``current`` (``model`` copied in when given; else
        the file already holds it), the other file spare."""
        self._current = current
        self.model = self._mapped(current, numel)
        if model is not None:
            np.copyto(self.model, model)
        self._spare = self._mapped(next(n for n in self._FILES if n != current), numel)

    def _load(self) -> None:
        assert self.state_dir is not None
        meta_path = self.state_dir / "global.json"
        if not meta_path.exists():
            return
        meta = json.loads(meta_path.read_text())
        if meta["model"].endswith(".npy"):  # written by an older service: one file per version
            old = np.load(self.state_dir / meta["model"])
            self._keep(self._FILES[0], old.size, old)
        else:
            self._keep(meta["model"], int(meta["numel"]))
        assert self.model is not None
        self.version = int(meta["version"])
        self.last_seq = {int(g): int(s) for g, s in meta["last_seq"].items()}
        self.clock.clocks = {int(g): int(c) for g, c in meta["clocks"].items()}
        self.clock.parked = set(self.clock.clocks)  # nobody is waited for until it speaks again
        self.taken = {int(e): {int(g): int(n) for g, n in by.items()} for e, by in meta.get("taken", {}).items()}
        if meta.get("schedule", {}).get("kind") == self.schedule.kind:
            self.clock.bound = self.schedule.restore(meta["schedule"]).bound
        self.resumed_from = self.version
        _log.warning("parameter service resumed from version %d (%d parameters) in %s", self.version,
                     self.model.size, self.state_dir)

    def _save(self) -> None:
        """Name the file now holding the model, with the version, clocks and sequence numbers."""
        if self.state_dir is None or self.model is None:
            return
        meta = {"model": self._current, "numel": int(self.model.size), "version": self.version,
                "last_seq": self.last_seq, "clocks": self.clock.clocks, "taken": self.taken,
                "schedule": self.schedule.state()}
        tmp = self.state_dir / "global.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.state_dir / "global.json")

    def _add(self, update: np.ndarray) -> None:
        """The model plus ``update``: in place, or (kept on disk) into the spare file, which the saved
        record then names, so a crash in between leaves the last saved model whole."""
        assert self.model is not None
        if self.state_dir is None:
            self.passes.add(self.model, update, out=self.model)
            return
        assert self._spare is not None
        self.passes.add(self.model, update, out=self._spare)
        self.model, self._spare = self._spare, self.model
        self._current = next(n for n in self._FILES if n != self._current)

    # ---- operations ----------------------------------------------------

    def hello(self, group: int, init: bytes, numel: int) -> dict[str, Any]:
        with self._cond:
            if self.model is None:
                if not init:
                    raise ValueError("the service holds no model yet: the first leader must send it")
                model = np.frombuffer(init, dtype=np.float32, count=numel).copy()
                if self.state_dir is not None:
                    self._keep(self._FILES[0], numel, model)
                else:
                    self.model = model
                self._save()
            elif self.model.size != numel:
                raise ValueError(f"the service's model has {self.model.size} parameters, the group's {numel}")
            self.last_seen[group] = time.monotonic()
            self.clock.activate(group)
            return {"version": self.version, "last_seq": self.last_seq.get(group, -1), "node": node_identity()}

    def exchange(self, group: int, seq: int, update: np.ndarray, wait: bool, epoch: int = -1, taken: int = 0,
                 ticks: int = 1, cost_s: float = 0.0) -> dict[str, Any]:
        """Apply a group's update (flat float32, decoded: `codec.decode`) once per ``seq``, then wait until the
        group is within the bound.
        ``epoch`` and ``taken`` report the group's progress as :meth:`progress` does; ``ticks``, the
        exchange periods the group worked since its last exchange (its clock advances by as many);
        ``cost_s``, what the group's previous exchange cost its leader (0: not known), which tells a staged
        schedule in its profile stage whether a coarse stage pays."""
        with self._cond:
            if self.model is None:
                raise ValueError("exchange before hello")
            if update.size != self.model.size:
                raise ValueError(f"an update of {update.size} values for a model of {self.model.size}")
            consumed = self._count(group, epoch, taken)
            duplicate = seq <= self.last_seq.get(group, -1)
            if not duplicate:
                self._add(update)
                self.version += 1
                self.last_seq[group] = seq
                self.clock.tick(group, ticks)
                if cost_s > 0:
                    self._price(cost_s)
                self._observe()
                self._save()
            self.last_seen[group] = time.monotonic()
            self._cond.notify_all()
            waited = 0.0
            if wait:
                started = time.monotonic()
                while not self.clock.may_proceed(group):
                    if time.monotonic() - started > self.wait_limit_s:
                        break
                    self._cond.wait(0.05)
                    self._park_silent(group)
                waited = time.monotonic() - started
                self.waits_s.append(waited)
            else:
                self.clock.park(group)
                self._cond.notify_all()
            gap = self.clock.gap(group)
            if wait:  # the staleness of a model a group trains on; a pushing group that does not wait discards it
                self.gaps[gap] += 1
            return {"version": self.version, "gap": gap, "duplicate": duplicate, "waited_s": waited,
                    "consumed": consumed, "stage": self.schedule.stage.name}

    def _observe(self) -> None:
        """A staged schedule's coarse stage: once a window has passed, feed the schedule the global model's
        change over it."""
        schedule = self.schedule
        if schedule.kind != "staged" or schedule.stage is not schedule.coarse or self.model is None:
            return
        now = time.monotonic()
        if self._mark is None or self._mark.size != self.model.size:
            self._mark, self._mark_t = self.model.copy(), now
            return
        elapsed = now - self._mark_t
        if elapsed < schedule.window_s:
            return
        self.passes.subtract(self.model, self._mark, out=self._mark)
        change = float(np.linalg.norm(self._mark))
        self.passes.copy(self.model, out=self._mark)
        self._mark_t = now
        before = schedule.stage
        stage = schedule.observe(change, elapsed)
        if stage is not before:
            self._switched({"rate": change / elapsed, "peak_rate": schedule.peak_rate},
                           f"the global model's change slowed to {change / elapsed:.3g}/s (peak "
                           f"{schedule.peak_rate:.3g}/s)")

    def _price(self, cost_s: float) -> None:
        """A staged schedule's profile stage: once enough exchanges are priced, go coarse where they are dear
        and straight to fine where the coarse stage would not pay."""
        schedule = self.schedule
        before = schedule.stage
        stage = schedule.priced(cost_s)
        if stage is before:
            return
        share = f"{schedule.pays:g} of the period"
        said = (f"an exchange costs {schedule.exchange_s:.3g} s, at least {share}: the coarse stage pays"
                if stage is schedule.coarse else
                f"an exchange costs {schedule.exchange_s:.3g} s, under {share}: the coarse stage would not pay")
        self._switched({"exchange_s": schedule.exchange_s}, said)

    def _switched(self, why: dict[str, Any], said: str) -> None:
        """The schedule moved to a new stage: hold every group to its bound (the leaders learn its period from
        the answers, which name the stage)."""
        stage = self.schedule.stage
        self.clock.bound = stage.bound
        self.switches.append({"version": self.version, "to": stage.name, **why})
        _log.info("%s: %s stage, bound %d, period %.3g s", said, stage.name, stage.bound, stage.period_s)
        self._cond.notify_all()

    def _count(self, group: int, epoch: int, taken: int) -> int | None:
        if epoch < 0:
            return None
        if taken < 0:
            raise ValueError(f"taken must be >= 0, not {taken}")
        by_group = self.taken.setdefault(epoch, {})
        by_group[group] = max(by_group.get(group, 0), taken)
        return sum(by_group.values())

    def progress(self, group: int, epoch: int, taken: int) -> dict[str, Any]:
        """Group ``group`` has taken ``taken`` samples of ``epoch`` so far (a running total: repeats and
        lost answers count once). The answer's ``consumed``, what all groups have taken from the epoch,
        tells a group when the epoch is used up; no model moves and no clock ticks."""
        with self._cond:
            self.last_seen[group] = time.monotonic()
            return {"consumed": self._count(group, epoch, taken)}

    def _park_silent(self, asking: int) -> None:
        now = time.monotonic()
        for group, seen in self.last_seen.items():
            if group != asking and group not in self.clock.parked and now - seen > self.silent_after_s:
                _log.warning("group %d silent for %.1fs: no longer waited for", group, now - seen)
                self.clock.park(group)

    def park(self, group: int) -> None:
        with self._cond:
            self.clock.park(group)
            self.last_seen[group] = time.monotonic()
            self._cond.notify_all()

    def level(self) -> None:
        with self._cond:
            self.clock.level()
            self._cond.notify_all()

    def regroup(self, leaders: list[int]) -> None:
        """Groups were re-formed after a full mix: the new groups' clocks start level, the old ones go."""
        with self._cond:
            top = max(self.clock.clocks.values(), default=0)
            self.clock.clocks = {g: top for g in leaders}
            self.clock.parked = set()
            now = time.monotonic()
            for g in leaders:
                self.last_seen[g] = now
            self._cond.notify_all()

    @property
    def numel(self) -> int:
        """The model's parameter count (0 before the first leader's hello)."""
        with self._cond:
            return 0 if self.model is None else int(self.model.size)

    def snapshot(self, into: Optional[np.ndarray] = None) -> bytes:
        """The global model's bytes; with ``into`` (a leader's shared buffer, or the buffer a connection sends
        its answers from), copied there instead."""
        with self._cond:
            if self.model is None:
                raise ValueError("the service holds no model yet")
            if into is not None:
                if into.size != self.model.size:
                    raise ValueError(f"a buffer of {into.size} values for a model of {self.model.size}")
                self.passes.copy(self.model, out=into)
                return b""
            return self.model.tobytes()

    def difference(self, held: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = model - held``: how the global model differs from what a leader holds (one pass, no copy of
        the model first)."""
        with self._cond:
            if self.model is None:
                raise ValueError("the service holds no model yet")
            return self.passes.subtract(self.model, held, out=out)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            waits = sorted(self.waits_s)
            return {"version": self.version, "bound": self.clock.bound, "clocks": dict(self.clock.clocks),
                    "gaps": {str(k): v for k, v in sorted(self.gaps.items())}, "exchanges": sum(self.gaps.values()),
                    "wait_p50_s": percentile(waits, 50) if waits else 0.0, "wait_max_s": waits[-1] if waits else 0.0,
                    "resumed_from": self.resumed_from, "start_version": self.start_version,
                    "stage": self.schedule.stage.name, "switches": list(self.switches),
                    "samples": {str(e): {str(g): n for g, n in sorted(by.items())}
                                for e, by in sorted(self.taken.items())}}
