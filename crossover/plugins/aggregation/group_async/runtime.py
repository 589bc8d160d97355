"""One job's group-level async state on one rank: its groups, their process sets, the service, the stage.

Decisions that ranks must agree on (groups, stage, steps per group) are taken
on rank 0 from gathered measurements and broadcast, at global boundaries that
every rank reaches: the first epoch's start, the end of the staged schedule's
profiling steps, and later epoch starts only while something may still change
(``speed`` grouping, or a ``staged`` schedule before its last stage). Every
other epoch start is local to a group: nobody waits for anybody.

Within an epoch, groups take samples until the epoch is used up, as the
parameter service counts it: each exchange reports the samples the group took,
and the answer says how many all groups have taken. A group that stalls
therefore takes a smaller share, and the others a larger one, without a
decision made in advance. Without the service, a group takes the steps the
last decision gave it. Between boundaries, groups talk only inside their
Horovod process set and, through their leaders, to the parameter service.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import socket
import statistics
import time
from collections import Counter, deque
from typing import Any, Optional

import torch

from crossover.plugins.aggregation.group_async.balance import member_batches
from crossover.plugins.aggregation.group_async.codec import Codec
from crossover.plugins.aggregation.group_async.grouping import Groups, parse_groups, speed_groups, steps_per_group
from crossover.plugins.aggregation.group_async.link import ServiceLink, ServiceProcess, flatten
from crossover.plugins.aggregation.group_async.schedule import Schedule, Stage
from crossover.plugins.aggregation.selection import AggregationError
from crossover.plugins.hook.settings import AggregationSettings

__all__ = ["GroupRuntime"]

_log = logging.getLogger(__name__)

# Horovod process sets by their ranks, until group_async training ends: Horovod refuses to add one twice.
_PROCESS_SETS: dict[tuple[int, ...], Any] = {}


# Regroup only when that cuts the waiting inside groups by this share of the ranks' summed pace.
_REGROUP_HYSTERESIS = 0.1


class GroupRuntime:
    """This rank's view of the job's groups; the optimizer and the sampler both act through it."""

    def __init__(self, hvd: Any, config: AggregationSettings) -> None:
        self.hvd = hvd
        self.config = config
        self.world = int(hvd.size())
        self.rank = int(hvd.rank())
        self.configured: Groups = parse_groups(config.groups, self.world)
        self.schedule = Schedule(config.group_schedule, config.exchange_period_s, config.staleness)
        self.stage: Stage = self.schedule.stage
        self.groups: Groups = ((tuple(range(self.world)),) if self.stage.synchronous else self.configured)
        self.params: list[torch.Tensor] = []
        self.service: Optional[ServiceProcess] = None
        self.link: Optional[ServiceLink] = None
        self.started = False
        self.finished = False
        self.boundaries = 0
        self.history: list[dict[str, Any]] = []
        self.exchanges = 0
        self._compute: deque[float] = deque(maxlen=1000)  # this rank's compute seconds per sample, by step
        self._batch = 1
        # inside the group: each member's share of the group's batch, and its pace as the group last heard it
        self._shares: tuple[int, ...] = ()
        self._member_paces: list[float] = []
        self._recent: deque[float] = deque(maxlen=16)  # seconds per sample at the current share
        self._address: Any = None
        self.boundary_left = 0.0  # time.perf_counter() when this rank last left an epoch start
        self._paces: list[float] = []
        # the current epoch, as this rank's group walks it
        self.epoch = 0
        self.epoch_samples = 0
        self.nominal: list[int] = []  # steps per group the last decision gave: the plan without the service
        self.epoch_over = False
        self.steps_in_epoch = 0
        self._expected = math.inf  # leader: the steps its group is expected to take (exchange each step after)
        self._consumed = 0  # leader: samples all groups took this epoch, as the last answer said
        self._share: Optional[float] = None  # leader: its group's share of the last epoch it finished
        self._last_exchange = time.monotonic()
        self._tick_credit = 0.0  # periods worked since the last exchange, not yet ticked
        self._global_before: Optional[torch.Tensor] = None
        self._start_version = 0  # the version a run resumed from a checkpoint continues from

    # ---- who I am ------------------------------------------------------

    @property
    def group_index(self) -> int:
        return next(i for i, g in enumerate(self.groups) if self.rank in g)

    @property
    def group(self) -> tuple[int, ...]:
        return self.groups[self.group_index]

    @property
    def leader(self) -> int:
        return self.group[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def process_set(self) -> Any:
        ranks = self.group
        if len(ranks) == self.world:
            return self.hvd.global_process_set
        return _PROCESS_SETS[ranks]

    def _ensure_sets(self) -> None:
        """Process sets are added by every rank together (Horovod's rule), so only at boundaries."""
        for ranks in self.groups:
            if len(ranks) < self.world and ranks not in _PROCESS_SETS:
                _PROCESS_SETS[ranks] = self.hvd.add_process_set(list(ranks))

    # ---- measurements (from the optimizer) -----------------------------

    def observe(self, compute_s: float) -> None:
        per_sample = compute_s / self.my_batch
        self._compute.append(per_sample)
        self._recent.append(per_sample)

    # ---- inside the group: who takes how much of its batch -----------------

    @property
    def shares(self) -> tuple[int, ...]:
        """Each member's samples per step, in the group's rank order (equal until measured paces differ)."""
        if len(self._shares) != len(self.group) or sum(self._shares) != len(self.group) * self._batch:
            return (self._batch,) * len(self.group)
        return self._shares

    @property
    def my_batch(self) -> int:
        return self.shares[self.group.index(self.rank)]

    def member_pace(self) -> float:
        """This rank's seconds per sample at its current share (median of its recent steps; 0: none yet)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def note_member_paces(self, paces: list[float]) -> None:
        """The members' paces as they rode in the group's allreduce: the same list on every member."""
        self._member_paces = paces

    def grad_scale(self) -> float:
        """What this rank's mean gradient is multiplied by before the group averages, so that the average
        weighs every sample alike when members take unequal shares."""
        shares = self.shares
        return len(shares) * self.my_batch / sum(shares)

    def _rebalance(self) -> None:
        """At a group's epoch start: re-split its batch by its members' paces (LB-BSP inside the group). Every
        member decides from the same allreduced paces, so every member takes the same split."""
        current = self.shares
        if (not self.config.group_balance or self.stage.synchronous or self.epoch_samples <= 0
                or len(self._member_paces) != len(current)):
            return
        split = member_batches(sum(current), self._member_paces, current)
        if split != current:
            _log.info("group_async: group %s re-splits its batch %s -> %s (seconds per sample %s)", self.group,
                      list(current), list(split), [round(p, 6) for p in self._member_paces])
            self._shares = split
            self._recent.clear()
            self.history.append({"epoch": self.epoch, "at": "re-split", "group": list(self.group),
                                 "shares": list(split)})

    def _reset_shares(self) -> None:
        self._shares, self._member_paces = (), []
        self._recent.clear()

    @property
    def _taken(self) -> int:
        """Samples this rank's group has taken from the epoch so far."""
        return self.steps_in_epoch * len(self.group) * self._batch

    def step_flags(self) -> tuple[bool, bool]:
        """Leader, once per step (the step counted): whether to exchange now (every ``period_s``
        seconds) and whether the epoch is used up. Near its expected share the leader asks the service
        at every step (a call without a model), so a group learns without delay that the epoch is over."""
        self.steps_in_epoch += 1
        exchange = (not self.stage.synchronous and self.link is not None
                    and time.monotonic() - self._last_exchange >= self.stage.period_s)
        over = False
        near = self.steps_in_epoch >= min(self._expected, self.nominal[self.group_index]) - 1
        if self.counted and self.link is not None and near and not exchange:
            over = self._over(self.link.progress(self.epoch, self._taken))
        return exchange, over

    def count_step(self) -> None:
        """A group member (not the leader), once per step."""
        self.steps_in_epoch += 1

    def _over(self, consumed: Optional[int]) -> bool:
        """Leader: whether the epoch is used up, from the service's count (``None``: it is away, and
        the group's planned steps decide)."""
        if consumed is None:
            return self.steps_in_epoch >= self.nominal[self.group_index]
        self._consumed = consumed
        return self.epoch_samples > 0 and consumed >= self.epoch_samples

    @property
    def counted(self) -> bool:
        """Whether the service counts the epoch's samples (every member knows the same)."""
        return self._address is not None and not self.stage.synchronous and self.epoch_samples > 0

    def epoch_done(self, steps: int) -> bool:
        """Whether this rank's group has finished the epoch after ``steps`` steps: the service said the
        epoch is used up, or (not counted) the group took its planned steps; never more steps than the
        whole epoch holds for the group alone."""
        cap = self.epoch_samples // (len(self.group) * self._batch) if self.epoch_samples else 0
        if self.epoch_over or steps >= cap:
            return True
        return not self.counted and steps >= self.nominal[self.group_index]

    # ---- flat parameters -----------------------------------------------

    def _load(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
                offset += n

    # ---- between boundaries: one exchange ------------------------------

    def exchange(self) -> None:
        """The group's exchange: the leader pushes and pulls, then hands the model to its group."""
        model: Optional[torch.Tensor] = None
        over = False
        if self.is_leader and self.link is not None:
            if self.service is not None:
                self.service.ensure_running()
            counted = self.counted
            model = self.link.exchange(self.params, wait=True, scale=self._weight(),
                                       epoch=self.epoch if counted else -1, taken=self._taken, ticks=self._ticks())
            if model is not None:
                self.exchanges += 1
            over = counted and self._over(self.link.consumed if model is not None else None)
        if len(self.group) > 1:
            numel = sum(p.numel() for p in self.params)
            packet = torch.zeros(numel + 2)
            if self.is_leader:
                packet[1] = 1.0 if over else 0.0
                if model is not None:
                    packet[0], packet[2:] = 1.0, model
            packet = self.hvd.broadcast(packet, root_rank=self.leader, process_set=self.process_set(),
                                        name="crossover.group_async.model")
            model = packet[2:] if packet[0] > 0 else None
            over = bool(packet[1] > 0)
        self.epoch_over = self.epoch_over or over
        if model is not None:
            self._load(model)
        # the period counts from the answer: a group held at the bound works a full period before asking again
        self._last_exchange = time.monotonic()

    def _ticks(self) -> int:
        """The exchange periods this group worked since its last exchange, whole ones, the rest carried to the
        next: a group whose step outlasts the period ticks the service's clock as often as a quick group
        does in the same time, so the staleness bound does not hold quick groups to a slow group's steps."""
        self._tick_credit += (time.monotonic() - self._last_exchange) / max(self.stage.period_s, 1e-9)
        ticks = max(1, int(self._tick_credit))
        self._tick_credit -= ticks
        return ticks

    def _weight(self) -> float:
        """How much of its own progress a group adds to the global model: ``size`` weighs a group by its
        share of the ranks (groups in lockstep then make exactly synchronous SGD's step), ``sum`` adds
        every group's update whole (Basu et al.: faster, noisier)."""
        return 1.0 if self.config.group_weight == "sum" else len(self.group) / self.world

    def park(self) -> None:
        """This group now waits at a global boundary, or has finished: the others must not wait for it."""
        if self.is_leader and self.link is not None and not self.stage.synchronous:
            self.link.park()

    # ---- boundaries ----------------------------------------------------

    def _start(self) -> None:
        """Rank 0 starts the service; every leader attaches from the same starting model."""
        hvd = self.hvd
        address: Any = None
        if self.rank == 0:
            single_host = int(hvd.local_size()) == self.world
            host = "127.0.0.1" if single_host else "0.0.0.0"
            self.service = ServiceProcess(host, self.config.staleness, self.config.param_state,
                                          start_version=self._start_version)
            try:
                _, port = self.service.start()
                reach = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
                address = (reach, port, self.service.token)
            except OSError as exc:
                _log.warning("group_async: could not start the parameter service (%s); groups train "
                             "synchronously inside and never exchange", exc)
        address = hvd.broadcast_object(address, root_rank=0, name="crossover.group_async.address")
        self._hold_shutdown()
        self._address = address
        self.started = True

    def _hold_shutdown(self) -> None:
        """Groups end training at different moments, and Horovod's shutdown (an explicit
        ``hvd.shutdown()`` or its own at exit) stops every rank: both wait for :meth:`finish` first."""
        hvd, original = self.hvd, self.hvd.shutdown
        if getattr(original, "_crossover_runtime", None) is not None:
            original = original._crossover_original

        def shutdown() -> None:
            try:
                self.finish()
            finally:
                original()

        shutdown._crossover_runtime = self  # type: ignore[attr-defined]
        shutdown._crossover_original = original  # type: ignore[attr-defined]
        hvd.shutdown = shutdown
        atexit.register(self.finish)

    def _attach_leader(self) -> None:
        if self.is_leader and self._address is not None:
            if self.link is None:
                host, port, token = self._address
                self.link = ServiceLink((host, port), token, group=self.rank,
                                        codec=Codec(self.config.exchange_codec, self.config.topk_fraction),
                                        shared_memory=self.config.exchange_shared_memory)
                self.link.start(flatten(self.params))

    def _mix(self) -> Optional[float]:
        """Every leader pushes; then every rank takes the same global model. The change of the global
        model since the last mix, or ``None`` when the service is away (then nothing is mixed)."""
        hvd = self.hvd
        if self.is_leader and self.link is not None:
            if self.service is not None:
                self.service.ensure_running()
            self.link.exchange(self.params, wait=False, scale=self._weight())
        hvd.allreduce(torch.zeros(1), name="crossover.group_async.pushed")  # every push is in
        packet = torch.zeros(sum(p.numel() for p in self.params) + 1)
        if self.rank == 0 and self.link is not None:
            model = self.link.pull(level=True)
            if model is not None:
                packet[0], packet[1:] = 1.0, model
        packet = hvd.broadcast(packet, root_rank=0, name="crossover.group_async.mix")
        if packet[0] <= 0:
            return None
        model = packet[1:]
        self._load(model)
        if self.link is not None:
            self.link.rebase(model)
        change = None if self._global_before is None else float(torch.linalg.vector_norm(model -
                                                                                          self._global_before))
        self._global_before = model.clone()
        return change

    def begin_epoch(self, epoch: int, samples: int, batch: int) -> list[int]:
        """The start of ``epoch`` (``samples`` samples, ``batch`` per rank and step): a global boundary
        while a decision may still change, else a local one. Returns the planned steps per group."""
        if self.started and not self._decisions_left():
            self._batch = batch
            self._enter_epoch(epoch, samples)
            self.boundary_left = time.perf_counter()
            if self.rank == 0:
                self.history.append({"epoch": epoch, "at": "local", "groups": [list(g) for g in self.groups],
                                     "steps": self.nominal, "stage": dataclasses.asdict(self.stage)})
            return list(self.nominal)
        return self.boundary("start", epoch, samples, batch)

    def _decisions_left(self) -> bool:
        """Whether a later epoch start may regroup or change the stage (all ranks know the same)."""
        return self.config.grouping == "speed" or (self.schedule.kind == "staged" and self.stage.name != "fine")

    def _nominal(self, groups: Groups, paces: list[float], samples: int, batch: int,
                 synchronous: bool) -> list[int]:
        """Steps per group over ``samples``: in proportion to measured paces, else an even split."""
        measured = bool(paces) and all(math.isfinite(p) and p > 0 for p in paces)
        if samples <= 0:
            return [0] * len(groups)
        if measured and not synchronous:
            return steps_per_group(groups, paces, samples, batch, balanced=self.config.group_balance)
        return [samples // (self.world * batch)] * len(groups)

    def _enter_epoch(self, epoch: int, samples: int) -> None:
        """Reset the epoch's counters; a leader expects its group's share of the last epoch again."""
        if self._consumed > 0 and self._taken > 0:
            self._share = self._taken / self._consumed
        self.epoch, self.epoch_samples = epoch, samples
        self.nominal = self._nominal(self.groups, self._paces, samples, self._batch, self.stage.synchronous)
        if samples <= 0:
            self._expected = math.inf
        elif self._share is not None:
            self._expected = self._share * samples / (len(self.group) * self._batch)
        else:
            self._expected = self.nominal[self.group_index]
        self.epoch_over = False
        self.steps_in_epoch = self._consumed = 0
        self._rebalance()

    def boundary(self, kind: str, epoch: int, samples: int, batch: int) -> list[int]:
        """A point every rank reaches (``start`` of an epoch, or ``profile`` end): mix, measure, regroup,
        and return the steps each group takes over the next ``samples`` samples."""
        hvd = self.hvd
        self._batch = batch
        if not self.started:
            self._start()
            change: Optional[float] = None
            self._global_before = flatten(self.params)
        else:
            self.park()  # this group now waits for the others: nobody must wait on it
            change = self._mix()
        # seconds of compute per sample, stalls included: what sets a rank's share of the work
        pace = statistics.fmean(self._compute) if self._compute else math.nan
        self._compute.clear()
        paces = hvd.allgather_object(pace, name="crossover.group_async.pace")
        if not any(math.isfinite(p) for p in paces) and len(self._paces) == len(paces):
            paces = list(self._paces)  # nothing measured yet: a resumed run plans from the paces it saved
        decision = None
        if self.rank == 0:
            decision = self._decide(kind, paces, change, samples, batch)
            if self.link is not None:  # before anyone leaves the boundary: only these groups' clocks count
                self.link.regroup([g[0] for g in decision["groups"]])
        decision = hvd.broadcast_object(decision, root_rank=0, name="crossover.group_async.decision")
        before = self.groups
        self.groups = tuple(tuple(g) for g in decision["groups"])
        self.stage = Stage(**decision["stage"])
        self._paces = list(decision["paces"])
        self._ensure_sets()
        if not self.is_leader and self.link is not None:
            self.link.close()
            self.link = None
        self._attach_leader()
        self._last_exchange = time.monotonic()
        if self.groups != before:
            self._share, self._consumed = None, 0  # new groups: no share carried over
            self._reset_shares()
        self._enter_epoch(epoch, samples)
        self.boundaries += 1
        self.boundary_left = time.perf_counter()
        self.history.append({"epoch": epoch, "at": kind, **decision})
        _log.info("group_async %s of epoch %d: groups %s, stage %s, steps %s", kind, epoch, self.groups,
                  self.stage.name, decision["steps"])
        return list(decision["steps"])

    def _decide(self, kind: str, paces: list[float], change: Optional[float], samples: int,
                batch: int) -> dict[str, Any]:
        measured = all(math.isfinite(p) and p > 0 for p in paces)
        if kind == "profile":
            stage = self.schedule.after_profile()
        elif kind == "start" and self.boundaries > 0:
            stage = self.schedule.at_epoch(change)
        else:
            stage = self.schedule.stage
        count = len(self.configured)
        if change is None and self.boundaries > 0 and not self.stage.synchronous:
            groups = self.groups  # nothing was mixed: a new group would hold different models
        elif stage.synchronous:
            groups = (tuple(range(self.world)),)
        elif self.config.grouping == "speed" and measured:
            current = self.groups if len(self.groups) == count else None
            groups = speed_groups(paces, count, current, _REGROUP_HYSTERESIS)
        else:
            groups = self.configured if self.config.grouping == "static" or len(self.groups) != count \
                else self.groups
        steps = self._nominal(groups, paces, samples, batch, stage.synchronous)
        return {"groups": [list(g) for g in groups], "steps": steps, "paces": paces, "change": change,
                "stage": dataclasses.asdict(stage)}

    # ---- checkpoints ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands, for a checkpoint: the global model's version as this rank last heard
        it (a leader's; save rank 0's, which always leads group 0), the schedule's stage, and the groups with
        the paces their steps were planned from. The model itself is the user's to save."""
        version = self.link.version if self.link is not None and self.link.version >= 0 else self._start_version
        return {"world": self.world, "version": version, "schedule": self.schedule.state(),
                "groups": [list(g) for g in self.groups],
                "paces": list(self._paces) if all(math.isfinite(p) for p in self._paces) else [],
                "boundaries": self.boundaries, "exchanges": self.exchanges}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s record: the next run continues the version, keeps its stage
        (no second profiling, no return to the coarse stage) and plans its first epoch from the saved
        paces. Before training starts; after, only this rank's own record is taken (and changes nothing):
        any other is refused. Groups and paces saved at another world size are dropped (the first
        boundary measures anew)."""
        if self.started:
            if state != self.state_dict():
                raise AggregationError("group_async: load the optimizer's state before training starts")
            return
        try:
            self.stage = self.schedule.restore(state["schedule"])
            world = int(state["world"])
            groups: Groups = tuple(tuple(int(r) for r in g) for g in state["groups"])
            paces = [float(p) for p in state["paces"]]
            version = int(state["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise AggregationError(f"group_async: not a state this optimizer saved ({exc})") from exc
        if world == self.world:
            if sorted(r for g in groups for r in g) != list(range(world)) or len(paces) not in (0, world):
                raise AggregationError(f"group_async: the saved groups {groups} or paces do not fit {world} ranks")
            self._paces = paces
        else:
            _log.warning("group_async: the checkpoint's %d ranks are %d now; its groups and paces are dropped",
                         world, self.world)
            groups = self.configured
        self.groups = (tuple(range(self.world)),) if self.stage.synchronous else groups
        self._start_version = max(0, version)
        self.boundaries = int(state.get("boundaries", 0))
        self.exchanges = int(state.get("exchanges", 0))
        _log.info("group_async: resuming at version %d, stage %s, groups %s", self._start_version, self.stage.name,
                  self.groups)

    # ---- what happened -------------------------------------------------

    def stats(self) -> dict[str, Any]:
        link = self.link
        gaps = Counter(link.gaps) if link is not None else Counter()
        service = link.stats() if (link is not None and self.rank == 0) else None
        return {
            "rank": self.rank, "groups": [list(g) for g in self.groups], "shares": list(self.shares),
            "stage": self.stage.name,
            "bound": self.stage.bound, "exchanges": self.exchanges,
            "gaps": {str(k): v for k, v in sorted(gaps.items())},
            "exchange_s_p50": statistics.median(link.exchange_s) if link is not None and link.exchange_s else None,
            "outages": link.outages if link is not None else 0,
            "service_restarts": self.service.restarts if self.service is not None else 0,
            "service": service, "history": self.history,
        }

    def finish(self) -> None:
        """Training is over on this rank: wait for every rank (one that left early would shut Horovod
        down under the others), mix one last time so every rank holds the same final model, and stop."""
        if self.started and not self.finished:
            self.finished = True
            try:
                self.park()
                self._mix()
                self._remove_sets()
            except (RuntimeError, ValueError) as exc:  # Horovod already shut down: nothing left to mix
                _log.warning("group_async: no final mix (%s)", exc)
        self.stop()

    def _remove_sets(self) -> None:
        """Every rank removes the groups' process sets together: Horovod's background loop serves each
        set at every cycle, so sets left behind would slow whatever the script trains next."""
        for ranks in list(_PROCESS_SETS):
            self.hvd.remove_process_set(_PROCESS_SETS.pop(ranks))

    def stop(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.service is not None:
            self.service.stop()
