"""One job's group-level async state on one rank: its groups, their process sets, the service, the stage.

Decisions that ranks must agree on (groups, steps per group) are taken on
rank 0 from gathered measurements and broadcast, at global boundaries that
every rank reaches: the first epoch's start and, under ``speed`` grouping, the
epoch starts the last decision named (`decisions`: each epoch while groups
change, then ever fewer). Every other epoch start is local to a group: nobody
waits for anybody. The staged schedule's stage is switched by the parameter
service, which sees the whole job's progress, and reaches each leader with its
next answer: it needs no boundary.

Between boundaries, groups talk only inside their Horovod process set and, through their leaders, to
the parameter service. What the runtime composes, each pure and tested on its own: the decisions at a
boundary (`decisions`), one group's epoch accounting (`epoch_account`), the split of a group's batch
among its members (`member_shares`); and the service's process (`service_process`) and link (`link`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections import Counter, deque
from typing import Any, Optional

import torch

from crossover.figures import percentile
from crossover.plugins.aggregation.group_async.checkpoint import read_record
from crossover.plugins.aggregation.group_async.codec import Codec
from crossover.plugins.aggregation.group_async.decisions import Boundary, Standing, decide, plan_steps
from crossover.plugins.aggregation.group_async.epoch_account import EpochAccount
from crossover.plugins.aggregation.group_async.flat_params import flatten, load_flat
from crossover.plugins.aggregation.group_async.grouping import Groups, parse_groups
from crossover.plugins.aggregation.group_async.handoff import Handoff
from crossover.plugins.aggregation.group_async.horovod_sets import ProcessSets, hold_shutdown
from crossover.plugins.aggregation.group_async.link import ServiceLink
from crossover.plugins.aggregation.group_async.member_shares import MemberShares
from crossover.plugins.aggregation.group_async.schedule import Schedule, Stage
from crossover.plugins.aggregation.group_async.service_process import ServiceProcess, start_for_job
from crossover.plugins.aggregation.group_async.stalls import StallMeter
from crossover.plugins.aggregation.selection import AggregationError
from crossover.settings import AggregationSettings

__all__ = ["GroupRuntime"]

_log = logging.getLogger(__name__)


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
        self.groups: Groups = self.configured
        self.sets = ProcessSets(hvd, self.world)
        self.params: list[torch.Tensor] = []
        self.service: Optional[ServiceProcess] = None
        self.link: Optional[ServiceLink] = None
        self.started = False
        self.finished = False
        self.boundaries = 0
        self.history: list[dict[str, Any]] = []
        self.exchanges = 0
        self._compute: deque[float] = deque(maxlen=1000)  # this rank's compute seconds per sample, by step
        self._stalls = StallMeter()
        # what a group step costs besides compute, in seconds: the gradients' allreduce (every step), the leader's
        # exchange with the service and the model's broadcast to the group (each exchange)
        self.costs: dict[str, deque[float]] = {k: deque(maxlen=4000) for k in ("allreduce", "exchange", "broadcast")}
        self.handoff: Optional[Handoff] = None  # how this rank's group hands the model over after an exchange
        self._batch = 1
        self.members = MemberShares(config.group_balance)  # inside the group: who takes how much of its batch
        self._address: Any = None
        self.boundary_left = 0.0  # time.perf_counter() when this rank last left an epoch start
        self._paces: list[float] = []
        self.account = EpochAccount()  # the current epoch, as this rank's group walks it
        self._global_before: Optional[torch.Tensor] = None
        self._start_version = 0  # the version a run resumed from a checkpoint continues from
        self._interval = 1  # epochs between the last two global boundaries
        self._next_boundary: Optional[int] = None  # the epoch of the next global boundary (None: none)
        self._met = 0.0  # time.perf_counter() when every rank had reached the last boundary

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
        return self.sets.of(self.group)

    def observe(self, compute_s: float) -> None:
        per_sample = compute_s / self.my_batch
        self._compute.append(per_sample)
        self._stalls.observe(per_sample)
        self.members.observe(per_sample)

    # ---- inside the group: who takes how much of its batch -----------------

    @property
    def shares(self) -> tuple[int, ...]:
        """Each member's samples per step, in the group's rank order (equal until measured paces differ)."""
        return self.members.of(len(self.group), self._batch)

    @property
    def my_batch(self) -> int:
        return self.shares[self.group.index(self.rank)]

    def member_pace(self) -> float:
        """This rank's seconds per sample at its current share (median of its recent steps; 0: none yet)."""
        return self.members.pace()

    def note_member_paces(self, paces: list[float]) -> None:
        """The members' paces as they rode in the group's allreduce: the same list on every member."""
        self.members.note(paces)

    def grad_scale(self) -> float:
        """What this rank's mean gradient is multiplied by before the group averages (`MemberShares.scale`)."""
        return MemberShares.scale(self.shares, self.group.index(self.rank))

    def _rebalance(self) -> None:
        """At a group's epoch start: re-split its batch by its members' paces."""
        if self.account.samples <= 0:
            return
        split = self.members.rebalance(len(self.group), self._batch)
        if split is not None:
            self.history.append({"epoch": self.account.epoch, "at": "re-split", "group": list(self.group),
                                 "shares": list(split)})

    # ---- within an epoch ---------------------------------------------------

    @property
    def _step_samples(self) -> int:
        return len(self.group) * self._batch

    def step_flags(self) -> tuple[bool, bool]:
        """Leader, once per step (the step counted): whether to exchange now (every ``period_s``
        seconds) and whether the epoch is used up. Near its expected share the leader asks the service
        at every step (a call without a model), so a group learns without delay that the epoch is over."""
        acc = self.account
        acc.steps += 1
        exchange = self.link is not None and acc.exchange_due(self.stage.period_s)
        over = False
        if self.counted and self.link is not None and acc.near_expected(self.group_index) and not exchange:
            over = acc.used_up(self.link.progress(acc.epoch, acc.taken(self._step_samples)), self.group_index)
        return exchange, over

    def count_step(self) -> None:
        """A group member (not the leader), once per step."""
        self.account.steps += 1

    @property
    def counted(self) -> bool:
        """Whether the service counts the epoch's samples (every member knows the same)."""
        return self._address is not None and self.account.samples > 0

    def epoch_done(self, steps: int) -> bool:
        """Whether this rank's group has finished the epoch after ``steps`` steps (`EpochAccount.done`)."""
        return self.account.done(steps, self.counted, self.group_index, self._step_samples)

    # ---- between boundaries: one exchange ------------------------------

    def exchange(self) -> None:
        """The group's exchange: the leader pushes and pulls, then hands the model to its group."""
        model: Optional[torch.Tensor] = None
        over = False
        started = time.perf_counter()
        if self.is_leader and self.link is not None:
            if self.service is not None:
                self.service.ensure_running()
            counted, acc = self.counted, self.account
            model = self.link.exchange(self.params, wait=True, scale=self._weight(),
                                       epoch=acc.epoch if counted else -1, taken=acc.taken(self._step_samples),
                                       ticks=acc.ticks(self.stage.period_s))
            if model is not None:
                self.exchanges += 1
                self._follow_stage()
            over = counted and acc.used_up(self.link.consumed if model is not None else None, self.group_index)
            self.costs["exchange"].append(time.perf_counter() - started)
        if self.handoff is not None:
            handed = time.perf_counter()
            model, over = self.handoff.hand(model, over)
            self.costs["broadcast"].append(time.perf_counter() - handed)
        self.account.over = self.account.over or over
        if model is not None:
            load_flat(self.params, model)
        self.account.exchanged()

    def _follow_stage(self) -> None:
        """A leader: take the stage the service's last answer named (it switches a staged schedule)."""
        name = self.link.stage if self.link is not None else None
        if name is None or name == self.stage.name:
            return
        try:
            stage = self.schedule.named(name)
        except ValueError:
            _log.warning("group_async: the service names stage %r, which this schedule lacks; kept %s", name,
                         self.stage.name)
            return
        self.stage = self.schedule.stage = stage
        self.history.append({"epoch": self.account.epoch, "at": "stage", "group": list(self.group),
                             "stage": dataclasses.asdict(stage), "version": self.link.version if self.link else None})
        _log.info("group_async: the service switched the schedule to the %s stage (period %.3g s, bound %d)",
                  stage.name, stage.period_s, stage.bound)

    def _weight(self) -> float:
        """How much of its own progress a group adds to the global model: ``size`` weighs a group by its
        share of the ranks (groups in lockstep then make exactly synchronous SGD's step), ``sum`` adds
        every group's update whole (Basu et al.: faster, noisier)."""
        return 1.0 if self.config.group_weight == "sum" else len(self.group) / self.world

    def park(self) -> None:
        """This group now waits at a global boundary, or has finished: the others must not wait for it."""
        if self.is_leader and self.link is not None:
            self.link.park()

    # ---- boundaries ----------------------------------------------------

    def _start(self) -> None:
        """Rank 0 starts the service; every leader attaches from the same starting model."""
        hvd = self.hvd
        address: Any = None
        if self.rank == 0:
            self.service, address = start_for_job(int(hvd.local_size()), self.world, self.config.staleness,
                                                  self.config.param_state, self._start_version,
                                                  self.schedule.kind, self.config.exchange_period_s,
                                                  self.config.param_port)
        address = hvd.broadcast_object(address, root_rank=0, name="crossover.group_async.address")
        hold_shutdown(hvd, self, self.finish)
        self._address = address
        self.started = True

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
        self._met = time.perf_counter()
        packet = torch.zeros(sum(p.numel() for p in self.params) + 1)
        if self.rank == 0 and self.link is not None:
            model = self.link.pull(level=True)
            if model is not None:
                packet[0], packet[1:] = 1.0, model
        packet = hvd.broadcast(packet, root_rank=0, name="crossover.group_async.mix")
        if packet[0] <= 0:
            return None
        model = packet[1:]
        load_flat(self.params, model)
        if self.link is not None:
            self.link.rebase(model)
        change = None if self._global_before is None else float(torch.linalg.vector_norm(model -
                                                                                          self._global_before))
        self._global_before = model.clone()
        return change

    def begin_epoch(self, epoch: int, samples: int, batch: int) -> list[int]:
        """The start of ``epoch`` (``samples`` samples, ``batch`` per rank and step): a global boundary when
        the last decision named this epoch, else a local one. Returns the planned steps per group."""
        if self.started and not self._boundary_due(epoch):
            self._batch = batch
            self._enter_epoch(epoch, samples)
            self.boundary_left = time.perf_counter()
            if self.rank == 0:
                self.history.append({"epoch": epoch, "at": "local", "groups": [list(g) for g in self.groups],
                                     "steps": self.account.nominal, "stage": dataclasses.asdict(self.stage)})
            return list(self.account.nominal)
        return self.boundary(epoch, samples, batch)

    def _boundary_due(self, epoch: int) -> bool:
        """Whether ``epoch`` starts at a global boundary (every rank knows the same: the last decision said)."""
        return self._next_boundary is not None and epoch >= self._next_boundary

    def _enter_epoch(self, epoch: int, samples: int) -> None:
        """Start the epoch's accounting from the plan for the current groups; re-split the group's batch."""
        nominal = plan_steps(self.groups, self._paces, samples, self._batch, self.world, self.config.group_balance)
        self.account.enter(epoch, samples, nominal, self.group_index, self._step_samples)
        self._rebalance()

    def boundary(self, epoch: int, samples: int, batch: int) -> list[int]:
        """A point every rank reaches at the start of ``epoch``: mix, measure, regroup, and return the steps
        each group takes over the next ``samples`` samples. What it cost this rank goes into the history:
        ``wait_s`` (until every rank was there and every push was in), ``mix_s`` (the global model to
        every rank), ``decide_s`` (gather the paces, decide, hear the decision) and ``sets_s`` (build the new
        groups' process sets)."""
        hvd = self.hvd
        self._batch = batch
        arrived = time.perf_counter()
        self._met = arrived
        if not self.started:
            self._start()
            change: Optional[float] = None
            self._global_before = flatten(self.params)
        else:
            self.park()  # this group now waits for the others: nobody must wait on it
            change = self._mix()
        mixed = time.perf_counter()
        # seconds of compute per sample, stalls included: what sets a rank's share of the work; its steady pace
        # (the median of its last steps), which a new group splits its batch by; and its stalls, which a group's
        # shares cannot balance away (`stalls`)
        pace = statistics.fmean(self._compute) if self._compute else math.nan
        steady = self.members.pace() or math.nan
        stall = self._stalls.take()
        self._compute.clear()
        measured = hvd.allgather(torch.tensor([[pace, steady, stall]], dtype=torch.float64),
                                 name="crossover.group_async.pace")
        paces, steadies = [float(p) for p in measured[:, 0]], [float(m) for m in measured[:, 1]]
        stalls = [float(x) for x in measured[:, 2]]
        if not any(math.isfinite(p) for p in paces) and len(self._paces) == len(paces):
            paces = list(self._paces)  # nothing measured yet: a resumed run plans from the paces it saved
        decision = None
        if self.rank == 0:
            decision = decide(Boundary(epoch, paces, stalls, change, samples, batch),
                              Standing(self.stage, self.config.grouping, self.config.group_balance, self.configured,
                                       self.groups, self.boundaries, self.world, self._interval))
            if self.link is not None:  # before anyone leaves the boundary: only these groups' clocks count
                self.link.regroup([g[0] for g in decision["groups"]])
        decision = hvd.broadcast_object(decision, root_rank=0, name="crossover.group_async.decision")
        decided = time.perf_counter()
        before = self.groups
        self.groups = tuple(tuple(g) for g in decision["groups"])
        self.stage = Stage(**decision["stage"])
        self._paces = list(decision["paces"])
        self._interval, self._next_boundary = int(decision["interval"]), decision["next_boundary"]
        self.sets.ensure(self.groups)
        if self.groups != before or (self.handoff is None and len(self.group) > 1):
            if self.handoff is not None:
                self.handoff.close()
            self.handoff = None if len(self.group) == 1 else Handoff(
                self.hvd, self.process_set(), self.group, self.rank, sum(p.numel() for p in self.params),
                self.config.exchange_shared_memory)
        built = time.perf_counter()
        if not self.is_leader and self.link is not None:
            self.link.close()
            self.link = None
        self._attach_leader()
        self.account.exchanged()
        if self.groups != before:
            self.account.forget_share()
            self.members.reset()
            if all(math.isfinite(steadies[r]) and steadies[r] > 0 for r in self.group):
                self.members.note([steadies[r] for r in self.group])  # the new group splits its batch at once
        self._enter_epoch(epoch, samples)
        self.boundaries += 1
        self.boundary_left = time.perf_counter()
        cost = {"wait_s": self._met - arrived, "mix_s": mixed - self._met, "decide_s": decided - mixed,
                "sets_s": built - decided}
        self.history.append({"epoch": epoch, "at": "start", **decision, "cost": cost})
        _log.info("group_async boundary at epoch %d: groups %s, steps %s, next boundary %s (waited %.3f s)", epoch,
                  self.groups, decision["steps"], decision["next_boundary"], cost["wait_s"])
        return list(decision["steps"])

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
        any other is refused (`checkpoint.read_record` checks the record)."""
        if self.started:
            if state != self.state_dict():
                raise AggregationError("group_async: load the optimizer's state before training starts")
            return
        saved = read_record(state, self.world)
        try:
            self.stage = self.schedule.restore(saved.schedule)
        except (KeyError, TypeError, ValueError) as exc:
            raise AggregationError(f"group_async: not a state this optimizer saved ({exc})") from exc
        if saved.paces is not None:
            self._paces = saved.paces
        groups = saved.groups if saved.groups is not None else self.configured
        self.groups = groups
        self._start_version, self.boundaries, self.exchanges = saved.version, saved.boundaries, saved.exchanges
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
            "handoff": None if self.handoff is None else
            ("shared memory" if self.handoff.through_shared_memory else "broadcast"),
            "step_costs_s": {k: {"p50": percentile(v, 50), "p90": percentile(v, 90), "count": len(v)}
                             for k, v in self.costs.items() if v},
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
                self.sets.remove_all()
            except (RuntimeError, ValueError) as exc:  # Horovod already shut down: nothing left to mix
                _log.warning("group_async: no final mix (%s)", exc)
        self.stop()

    def stop(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.service is not None:
            self.service.stop()
