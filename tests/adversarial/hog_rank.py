"""A rank that keeps its device: it reports a day-long compute phase, asks again, and then only heartbeats.

Usage: python hog_rank.py SOCKET SECONDS STATUS_FILE

Speaks the wire protocol itself over the gRPC Session stream (as any client
could), so nothing in the plugin stops it. Writes `granted` to STATUS_FILE once
it holds the device for the second time, then heartbeats for SECONDS.
"""
from __future__ import annotations

import os
import queue
import sys
import time

import grpc

from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity


def main(socket: str, seconds: float, status: str) -> None:
    ident = RankIdentity(job_id="hog", job_name="hog", rank=0, local_rank=0, world_size=1, local_size=1,
                         device=0, pid=os.getpid(), node="")
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        reg = stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=ident.to_pb()), timeout=5)
        out: queue.SimpleQueue = queue.SimpleQueue()

        def events():
            yield pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id)
            while True:
                ev = out.get()
                if ev is None:
                    return
                yield ev

        replies = stub.Session(events())

        def granted(seq: int) -> None:
            for d in replies:
                if d.WhichOneof("kind") == "grant" and d.grant.seq == seq:
                    return

        out.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=0, seq=1))
        granted(1)
        out.put(pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=0, duration_s=86_400.0, comm_begins=True))
        out.put(pb.RankEvent(kind=pb.COMPUTE_REQUEST, iteration=1, seq=2))
        granted(2)
        with open(status, "w") as f:
            f.write("granted")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.put(pb.RankEvent(kind=pb.HEARTBEAT))
            time.sleep(0.1)
        out.put(None)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
