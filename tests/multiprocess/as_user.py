"""Run the `crossover` CLI, a rank's session, or one raw admin call as another user (tests only).

Usage: python as_user.py UID GID cli ARGS... | rank SOCKET | raw-drain SOCKET

Everything it needs is imported while still root; then it drops to UID/GID, so
the interpreter's own files need not be readable by that user.
"""
from __future__ import annotations

import json
import os
import sys

import click  # noqa: F401 - imported before the privileges drop
import google.protobuf.json_format  # noqa: F401
import grpc
import rich.console  # noqa: F401
import rich.live  # noqa: F401
import rich.table  # noqa: F401
import rich.text  # noqa: F401

from crossover.client import cli
from crossover.client.rank.session import Session
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings


def _rank(socket: str) -> int:
    settings = PluginSettings(target=f"unix://{socket}", job_name="", device=0, grant_timeout_s=10.0,
                              reconnect_interval_s=60.0, pin=False)
    s = Session(RankIdentity("second-user-job", "second-user", 0, 0, 1, 1, device=0), settings).start()
    try:
        granted = []
        for i in range(3):
            granted.append(s.acquire(i))
            s.release(i)
        print(json.dumps({"attached": s.attached, "granted": granted, "transport": s.transport}))
    finally:
        s.close()
    return 0


def _raw_drain(socket: str) -> int:
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        try:
            pb_grpc.AdminStub(ch).Drain(pb.DeviceRequest(protocol_version=PROTOCOL_VERSION, device=0), timeout=5)
        except grpc.RpcError as exc:
            print(exc.code().name)
            return 0
    print("OK")
    return 0


def main() -> int:
    uid, gid, what, *args = sys.argv[1:]
    os.setgroups([int(gid)])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if what == "cli":
        return cli.main(args, standalone_mode=True)
    return {"rank": _rank, "raw-drain": _raw_drain}[what](args[0])


if __name__ == "__main__":
    sys.exit(main())
