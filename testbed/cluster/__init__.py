"""An emulated cluster on one machine: network namespaces, shaped links, one crossoverd per node.

Layout of a cluster whose namespaces share the prefix `xo<pid>c<k>` (unique per
owning process and cluster, so parallel runs and tests never collide)::

    hub namespace  `<prefix>h`: bridge `br0` 10.77.0.254/24, veth `n<i>` per node
      |                         (the hub end of node i's link, shaped for downloads)
    node namespace `<prefix>n<i>`: `eth0` 10.77.0.<i+1>/24 (shaped for uploads),
                                   crossoverd --cpu-devices <core i> --node-name node<i>

Nothing is created in the root namespace and no route leaves the bridge: the
addresses exist only inside namespaces this module made. Each node's link is a
tc `tbf` on both ends of its veth (rate), under a `netem` (delay, jitter) where
the kernel has one.

Jobs are launched with Horovod's own Gloo runner (`horovod.runner.gloo_run.
launch_gloo`: host assignment, rendezvous server, per-slot environment, output
forwarding, terminate-all-on-failure) running inside the hub namespace; only
the per-slot `exec_command` is ours: instead of ssh it wraps each rank's
command in `ip netns exec <node namespace>` and points the plugin at that
node's daemon.

Teardown (`down`) kills every process inside the cluster's namespaces (found
with `ip netns pids`, so ranks that escaped their launcher are found too) and
deletes the namespaces, which destroys the veths and the bridge. It runs on
leaving the `with` block (exception or not), on SIGTERM/SIGHUP (turned into
`SystemExit`), on Ctrl-C (`KeyboardInterrupt`) and at interpreter exit.
`down --stale` removes what a SIGKILLed owner left behind.

    python -m testbed.cluster up --nodes 2 --rate 200mbit --policy crossover --name demo
    python -m testbed.cluster run --cluster demo -- python train.py      # another terminal
    python -m testbed.cluster run --nodes 2 --rate 100mbit -- python train.py  # ephemeral
    python -m testbed.cluster shape --cluster demo --node 1 --rate 50mbit
    python -m testbed.cluster down demo | down --stale

Modules: `spec` (what to build, what was built), `netns` (namespaces, veth,
bridge, teardown), `shaping` (tc), `launch` (daemons and jobs inside the
namespaces), `cluster` (`Cluster`, which owns one), `cli` (`python -m testbed.cluster`).
"""
from __future__ import annotations

import os

# This package forks+execs daemons and ranks while its process may hold gRPC channels
# (readiness checks, a benchmark's SetPolicy calls). gRPC's own fork handlers can then
# deadlock inside fork() (grpc/grpc#37259).
# Every child execs at once, so the handlers buy nothing: turn them off before gRPC starts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from .cluster import Cluster  # noqa: E402
from .launch import ClusterJob, launch_job  # noqa: E402
from .netns import cleanup_stale, netem_available, preflight  # noqa: E402
from .shaping import LOWER_EFFORT_DSCP, measure_side_by_side, measure_throughput  # noqa: E402
from .spec import ClusterError, ClusterSpec, ClusterState, Link, Node, Unsupported, parse_rate  # noqa: E402

__all__ = [
    "Link",
    "ClusterSpec",
    "Node",
    "ClusterState",
    "Cluster",
    "ClusterJob",
    "ClusterError",
    "Unsupported",
    "preflight",
    "netem_available",
    "parse_rate",
    "launch_job",
    "measure_throughput",
    "measure_side_by_side",
    "LOWER_EFFORT_DSCP",
    "cleanup_stale",
]
