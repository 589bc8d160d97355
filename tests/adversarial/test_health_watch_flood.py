"""Health Watch streams, on the unauthenticated probe port and on the rank socket, cannot freeze the daemon.

Before: the synchronous health servicer ran each Watch on a thread of the pool
that every unary call (Register, GetQueue, the admin calls) runs on, and a
Watch kept its thread after its client cancelled it: 48 of them from anyone who
reached the probe port froze the control plane and SIGTERM no longer stopped
the daemon. Now health runs on the event loop and the probe port serves Check only.
"""
from __future__ import annotations

import socket

import grpc
import pytest
from attack_bed import answers_within, grant_waits, start_victim, stops_on_sigterm
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]

STREAMS = 48  # more than the 32 threads of the daemon's pool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_watches(target: str, n: int) -> tuple[grpc.Channel, list]:
    ch = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(ch)
    calls = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3) for _ in range(n)]
    return ch, calls


def test_watch_streams_leave_the_control_plane_answering(daemon_factory, jobs, tmp_path):
    port = _free_port()
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--health-address", f"127.0.0.1:{port}")
    victim = start_victim(d, tmp_path)
    jobs.append(victim)

    probe_ch, probe_calls = _open_watches(f"127.0.0.1:{port}", STREAMS)
    sock_ch, sock_calls = _open_watches(f"unix://{d.socket}", STREAMS)
    for call in probe_calls + sock_calls:  # the attack: open, see the stream served, then go away
        try:
            next(call)
        except grpc.RpcError:
            pass  # refused (the probe port now)
        call.cancel()
    probe_ch.close()
    sock_ch.close()

    assert answers_within(d, 1.0) < 1.0
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=1.0))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the probe port serves Check only
    with grpc.insecure_channel(f"unix://{d.socket}") as ch:  # local clients may still Watch, on the loop
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5.0)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()

    assert victim.wait(120) == 0, victim.output()[-3000:]
    waits = grant_waits(d, "victim")
    assert waits and max(waits) < 2.0, max(waits)  # a two-rank job alone: each grant at once
    assert stops_on_sigterm(d) < 5.0
