"""A discrete-event cluster simulator that drives the daemon's own policies on a simulated clock.

Planning past one machine: what does `crossover` buy on 64 nodes x 8 GPUs with
2-4 jobs per GPU, jittery phases, and jobs arriving and leaving? The simulator
answers with the same policy classes the daemon runs (`crossover.daemon.policies`),
one instance per node as one daemon per node, fed the events a real rank sends
(`join`, `request`, `observe`, `release`, `leave`) and `tick` at the policy's
deadlines. Only the world around the policies is modelled:

* A rank of job j asks for its device for iteration i+1 when j's allreduce i
  completes (iteration 0: when every rank has joined, as after Horovod's init).
  Once granted it computes for its own draw of compute time (per-rank mean,
  lognormal jitter of mean 1), reports `observe('compute')` and `release`s.
* The allreduce of iteration i starts when every rank of the job has finished
  its compute, and needs `comm_s` (jittered) of link time. Each (node, device)
  has its own link (one NIC per GPU, as in the emulated cluster where each node
  has one device and one link); allreduces crossing a link at the same time
  share it, so a job's allreduce runs at 1/k of full speed where k is the
  largest number of allreduces on any of its links (`shared_links=False`: a
  fixed delay). `link_sharing="fifo"` instead serves a link's allreduces in the
  order they began (the earliest runs at full speed, the others wait).
  Unscheduled co-located jobs stay in lockstep under `fair` (neutrally
  stable) and fall into alternation under `fifo`; the emulated cluster's
  links behave in between (why is not established), so the two bracket what
  an unscheduled cluster does. Each rank then reports `observe('comm')` for
  its comm phase (from its release to the allreduce's end).
* Ranks computing on one device at once (what `passthrough` allows) share it
  by processor sharing: each of k progresses at 1/(k * (1 + switch_penalty)).
* Ticks: with `tick_s`, on a fixed cadence per node like the daemon's reaper
  (`reap_interval_s`, 0.1 s); otherwise exactly at the policy's `next_deadline()`.
  Only while some device has waiting ranks and no holder: the only state in
  which a tick can change anything.

`turns` is the rotation the daemon retired (`testbed.simulator.turns`), kept
for comparison; `turns-nosync` is `turns` without crossover synchronization
(`TurnsSettings(tiebreak="join_order")`): identical keys, backfilling and
bounded waits, but ties are broken by the order jobs joined *that node*, so
nodes may disagree. `crossover-link` (`testbed.simulator.link`) is `crossover` with
allreduces kept apart on each device's link, which wins here and lost on the
device-model bed with real daemons, so the daemon does not carry it.
`reference` searches fixed serve orders offline.

Everything is seeded: the same inputs give the same result, event for event.

Modules: `spec` (what to simulate: jobs, the world's settings, the policies by
name), `state` and `world` (the simulated ranks, jobs, devices and nodes, and
the event loop), `metrics` (what a run measured), `run` (`simulate`,
`simulate_small`), `reference` (the best fixed cyclic orders of a small instance),
`turns` (the retired rotation policy), `link` (the `crossover-link` variant).
"""
from __future__ import annotations

from .metrics import JobResult, SimResult, alone_iteration_s
from .run import simulate, simulate_small
from .spec import LINK_SHARING, POLICIES, SMALL_POLICIES, JobSpec, PolicyFactory, SimConfig, SimulationError
from .state import ComputeSpan

__all__ = [
    "JobSpec",
    "SimConfig",
    "JobResult",
    "SimResult",
    "ComputeSpan",
    "SimulationError",
    "LINK_SHARING",
    "POLICIES",
    "PolicyFactory",
    "SMALL_POLICIES",
    "simulate",
    "simulate_small",
    "alone_iteration_s",
]
