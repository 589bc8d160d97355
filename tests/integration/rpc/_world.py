"""The gRPC edge tests' helpers: an in-process scheduler core, rank identities, raw calls and directives.

The fixtures (`serve`, `channels`, `streams`, `sessions`) are in this folder's `conftest.py`."""
from __future__ import annotations

import dataclasses
import os
import queue
import threading

import grpc
import pytest

from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from testbed.harness.polling import wait_until

_END = object()

_LIVENESS = {f.name for f in dataclasses.fields(LivenessSettings)}


def make_core(**kw) -> Scheduler:
    inv = Inventory([Device(0, "cpu", "cpu0", (0,)), Device(1, "cpu", "cpu1", (1,))])
    kw.setdefault("heartbeat_interval_s", 0.1)
    kw.setdefault("heartbeat_timeout_s", 0.8)
    kw["liveness"] = LivenessSettings(**{k: kw.pop(k) for k in list(kw) if k in _LIVENESS})
    kw.setdefault("policy", "exclusive")
    kw.setdefault("adapt", False)
    return Scheduler(inv, SchedulerSettings(node="node-rpc", **kw), event_log=EventLog())


def identity(job: str = "job-x", rank: int = 0, world: int = 2, device: int = 0, pid: int | None = None):
    return pb.RankIdentity(job_id=f"id-{job}", job_name=job, rank=rank, local_rank=rank, world_size=world,
                           local_size=world, node="n", device=device, pid=pid or os.getpid())


def register(stub: pb_grpc.SchedulerStub, metadata=None, **kw) -> pb.RegisterResponse:
    return stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=identity(**kw)), timeout=5,
                         metadata=metadata)


def holding_stream(stub: pb_grpc.SchedulerStub, streams, job: str) -> tuple[queue.SimpleQueue, grpc.Call]:
    """A 1-rank job's raw stream that asked for device 0 and was granted it (it holds it until told)."""
    reg = register(stub, job=job, world=1)
    q, call = streams(stub, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id),
                      pb.RankEvent(kind=pb.COMPUTE_REQUEST, seq=1))
    assert first_directive(call).grant.seq == 1
    return q, call


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    return wait_until(predicate, timeout, interval=interval)


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    return err.value


def first_directive(call: grpc.Call, timeout: float = 5.0) -> pb.Directive:
    """Next directive from a stream but for device-share news and heartbeat answers, with a bound;
    runs the blocking `next` in a helper thread."""
    box: queue.SimpleQueue = queue.SimpleQueue()

    def take() -> None:
        d = next(call, None)
        while d is not None and (d.HasField("share") or d.HasField("alive")):
            d = next(call, None)
        box.put(d)

    threading.Thread(target=take, daemon=True).start()
    return box.get(timeout=timeout)
