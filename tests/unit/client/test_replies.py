"""The daemon's Admin replies as records: each protobuf message → its record, enums as words, unset as None,
and the JSON `crossover --json` builds from them."""
from __future__ import annotations

import dataclasses

from crossover.client.cli.formatting import JSON_VERSION, to_json
from crossover.client.replies import (
    DeviceAck,
    DeviceState,
    EvictReply,
    JobList,
    JobState,
    PolicyInfo,
    QueueState,
    RankState,
)
from crossover.protos import crossover_v1_pb2 as pb


def _queue() -> pb.QueueState:
    state = pb.QueueState(node="n0", policy="exclusive", uptime_s=12.5, overdue_total=3, connections=2,
                          max_connections=1024)
    dev = state.devices.add(index=0, kind="gpu", name="H100", utilization=-1.0, memory_total_bytes=80 << 30,
                            order=["prod", "sweep"], sharing="scheduled", sharing_reason="grants pay")
    dev.holders.add(job_id="id-prod", job_name="prod", rank=0, pid=42, phase=pb.COMPUTE, iteration=2**40,
                    cpu_percent=-1.0, priority=pb.PRIORITY_HIGH, weight=1.0, handover="device",
                    memory_cap_bytes=0)
    dev.waiting.add(job_id="id-sweep", job_name="sweep", rank=1, phase=pb.WAITING, cpu_percent=12.5,
                    priority=pb.PRIORITY_LOW, handover="")
    dev.isolation.CopyFrom(pb.Isolation(window="shared", target=0.97, budget=0.2, lower_share={"sweep": 0.15}))
    state.devices.add(index=1, kind="cpu", name="cpu1", utilization=40.0)
    return state


def test_a_queue_becomes_records_with_enums_as_words_and_unset_fields_none():
    state = QueueState.from_pb(_queue())
    assert (state.node, state.policy, state.overdue_total, state.connections) == ("n0", "exclusive", 3, 2)
    gpu, cpu = state.devices
    holder, waiter = gpu.holders[0], gpu.waiting[0]
    assert (holder.phase, holder.priority, holder.handover) == ("compute", "high", "device")
    assert (waiter.phase, waiter.priority, waiter.handover) == ("waiting", "low", "cpu")  # the wire's "": cpu
    assert holder.iteration == 2**40 and isinstance(holder.iteration, int)
    assert holder.memory_cap_bytes == 0 and waiter.memory_cap_bytes is None  # a cap of nothing, and no cap
    assert holder.cpu_percent is None and waiter.cpu_percent == 12.5  # -1: not measured
    assert gpu.utilization is None and cpu.utilization == 40.0
    assert gpu.isolation is not None and gpu.isolation.lower_share == {"sweep": 0.15}
    assert cpu.isolation is None and cpu.holders == () and cpu.order == ()
    assert gpu.ranks == (holder, waiter)


def test_an_enum_value_this_client_does_not_know_is_unknown_not_a_guess():
    rank = RankState.from_pb(pb.RankState(phase=pb.PHASE_UNSPECIFIED, priority=pb.PRIORITY_UNSPECIFIED))
    assert (rank.phase, rank.priority) == ("unknown", "unknown")
    future = RankState.from_pb(pb.RankState(phase=99, priority=7))  # a newer daemon's values
    assert (future.phase, future.priority) == ("unknown", "unknown")


def test_every_other_reply_becomes_its_record():
    job = pb.JobState(job_id="id-j", job_name="j", world_size=4, priority=pb.PRIORITY_NORMAL, weight=2.0,
                      class_set_by="operator", framework="ddp")
    job.ranks.add(job_id="id-j", rank=3, phase=pb.COMM, device=1)
    record = JobState.from_pb(job)
    assert (record.priority, record.weight, record.class_set_by, record.framework) == ("normal", 2.0, "operator", "ddp")
    assert [(r.rank, r.phase, r.device) for r in record.ranks] == [(3, "comm", 1)]
    assert JobList.from_pb(pb.JobList(jobs=[job])).jobs == (record,)
    policy = PolicyInfo.from_pb(pb.PolicyInfo(name="crossover", available=["crossover", "exclusive"], adapt=True,
                                              protect=0.9))
    assert policy == PolicyInfo("crossover", ("crossover", "exclusive"), adapt=True, handover=False, protect=0.9)
    assert DeviceAck.from_pb(pb.DeviceAck(device=2, draining=True)) == DeviceAck(2, True)
    assert EvictReply.from_pb(pb.EvictReply(done=["a rank 0 on device 0: moved aside"])).done == (
        "a rank 0 on device 0: moved aside",)


def test_the_json_is_the_records_fields_under_their_names_with_a_version():
    """The keys scripts read, pinned: a proto field renamed must not change them (the record keeps its name)."""
    data = to_json("queue", QueueState.from_pb(_queue()))
    assert data["version"] == JSON_VERSION == 2 and data["kind"] == "queue"
    assert set(data) == {"version", "kind", "node", "policy", "uptime_s", "devices", "overdue_total", "connections",
                         "max_connections"}
    gpu = data["devices"][0]
    assert set(gpu) == {f.name for f in dataclasses.fields(DeviceState)} == {
        "index", "kind", "name", "draining", "holders", "waiting", "others", "utilization", "memory_used_bytes",
        "memory_total_bytes", "memory_free_bytes", "order", "refused_while_draining", "sharing", "sharing_reason",
        "isolation"}
    holder = gpu["holders"][0]
    assert set(holder) == {
        "job_id", "job_name", "rank", "local_rank", "pid", "phase", "iteration", "mean_compute_s", "mean_comm_s",
        "wait_fraction", "cpu_percent", "rss_bytes", "gpu_memory_bytes", "since_s", "user", "priority", "weight",
        "handover", "framework", "device", "memory_cap_bytes", "memory_note"}
    assert (holder["phase"], holder["priority"], holder["cpu_percent"]) == ("compute", "high", None)
    assert gpu["waiting"][0]["memory_cap_bytes"] is None and data["devices"][1]["isolation"] is None
    assert gpu["isolation"]["lower_share"] == {"sweep": 0.15}
