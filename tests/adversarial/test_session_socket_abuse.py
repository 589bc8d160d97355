"""What one client of the session socket can cost the others: a trickled frame, a user's share of the
slots, and what it says about itself (its pid, its job's name), against a live daemon beside a victim job.

Before: a frame header for 1 MiB and then a byte every few seconds held a slot,
a thread and the buffer until the idle timeout (60 s), since the timeout was per
read; one local user could take all 1024 slots; every refused connection logged
a WARNING; a rank's pid was whatever it claimed (so `crossover queue` and the
liveness check believed pid 1), and a job name went into the log raw
(newlines, ANSI escapes).
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from attack_bed import NOBODY, NOGROUP, answers_within, grant_waits, start_victim, stops_on_sigterm

from crossover.client.rank.transport import FrameStream
from crossover.protos import PROTOCOL_VERSION, framing
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
from testbed.harness.daemon import queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]

def test_a_trickled_frame_is_cut_off_at_the_frame_deadline(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive")
    victim = start_victim(d, tmp_path)
    jobs.append(victim)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(f"{d.socket}.session")
    slow.settimeout(0.3)
    slow.sendall(struct.pack(">I", framing.MAX_FRAME))  # announces 1 MiB
    t0 = time.monotonic()
    closed_after, got = None, b""
    while time.monotonic() - t0 < 8.0:
        try:
            slow.sendall(b"\0")  # one byte at a time, well inside every per-read timeout
        except OSError:
            closed_after = time.monotonic() - t0
            break
        try:
            data = slow.recv(65536)
            got += data
            if data == b"":
                closed_after = time.monotonic() - t0
                break
        except TimeoutError:
            pass
        except OSError:
            closed_after = time.monotonic() - t0
            break
    slow.close()
    assert closed_after is not None and closed_after < 3.5, closed_after  # the frame deadline, 2 s
    assert b"did not arrive whole within 2 s" in got  # told why, in a SessionError
    assert answers_within(d, 1.0) < 1.0
    assert victim.wait(120) == 0, victim.output()[-3000:]
    assert grant_waits(d, "victim")


_HOLD = """
import os, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})
held, refused = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(0.5)
    try:
        data = s.recv(4096)
    except (TimeoutError, socket.timeout):
        data = None
    if data:
        refused += 1
        s.close()
    else:
        held.append(s)
print(len(held), refused, flush=True)
sys.stdin.read()  # holds its connections until the test closes our stdin
"""


def test_one_user_cannot_take_every_slot_and_refusals_do_not_flood_the_log(daemon_factory, jobs, base, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--socket-group", str(NOGROUP),
                       "--max-connections-per-user", "4", socket=base / "run" / "d.sock")
    hold = subprocess.Popen([sys.executable, "-c", _HOLD.format(uid=NOBODY, gid=NOGROUP), f"{d.socket}.session", "40"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hold.stdout is not None and hold.stdin is not None
        counts = hold.stdout.readline().split()
        assert len(counts) == 2, hold.stderr.read() if hold.stderr else ""
        held, refused = map(int, counts)
        assert (held, refused) == (4, 36)
        victim = start_victim(d, tmp_path)  # root's ranks still find slots while nobody holds its share
        jobs.append(victim)
        assert victim.wait(120) == 0, victim.output()[-3000:]
        assert grant_waits(d, "victim")
        hold.stdin.close()
        hold.wait(10)
    finally:
        hold.kill()
        hold.wait()
    refusal_lines = [line for line in d.log.read_text().splitlines() if "refused" in line and "session socket" in line]
    assert 1 <= len(refusal_lines) <= 2, refusal_lines  # one summary line, not 36
    assert stops_on_sigterm(d) < 5.0


@contextlib.contextmanager
def _session(channel: grpc.Channel, ident: RankIdentity) -> Iterator[FrameStream]:
    """A rank's session, registered over `channel` and open on the session socket, one heartbeat sent."""
    reg = pb_grpc.SchedulerStub(channel).Register(
        pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, identity=ident.to_pb()), timeout=5)
    stream = FrameStream(reg.session_socket, pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id), 5.0)
    try:
        stream.send(pb.RankEvent(kind=pb.HEARTBEAT))
        yield stream
    finally:
        stream.close()
        stream.dispose()


def test_the_kernel_names_a_ranks_process_and_a_job_name_reaches_the_log_inert(daemon_factory):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive")
    evil = "evil\n2026-11-25 00:00:00 crossoverd INFO everything is fine\x1b[2J"
    ident = RankIdentity(job_id="liar", job_name=evil, rank=0, local_rank=0, world_size=1, local_size=1,
                         device=0, pid=1)  # claims to be init
    with grpc.insecure_channel(f"unix://{d.socket}") as ch, _session(ch, ident):
        deadline = time.monotonic() + 5
        while True:
            ranks = [r for dev in queue_state(d.socket)["devices"] for key in ("holders", "waiting", "others")
                     for r in dev.get(key, [])]
            liar = [r for r in ranks if r.get("job_id") == "liar"]
            if liar and int(liar[0]["pid"]) == os.getpid() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert liar and int(liar[0]["pid"]) == os.getpid(), liar  # the kernel's pid, not the claimed 1
        assert liar[0]["job_name"] == evil.encode("unicode_escape").decode().replace("\\\\", "\\")
    log = d.log.read_text()
    assert "everything is fine" not in log.split("evil")[0]  # nothing before it was forged
    assert not any(line.startswith("2026-11-25 00:00:00") for line in log.splitlines())
    assert "\x1b" not in log and "\x1b" not in d.event_log.read_text()


_IMPOSTOR = """
import os, sys
import grpc
from crossover.client.rank.transport import FrameStream, GrpcStream, StreamBroken
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.identity import RankIdentity
os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})  # imported first: nobody cannot read root's Python
ident = RankIdentity(job_id="prod-id", job_name="prod", rank=1, local_rank=1, world_size=2, local_size=2, device=0,
                     pid=os.getpid())
with grpc.insecure_channel("unix://" + sys.argv[1]) as ch:
    stub = pb_grpc.SchedulerStub(ch)
    reg = stub.Register(pb.RegisterRequest(
        protocol_version=PROTOCOL_VERSION, identity=ident.to_pb(), priority=pb.PRIORITY_LOW), timeout=5)
    first = pb.RankEvent(kind=pb.OPEN, session_id=reg.session_id)
    stream = FrameStream(reg.session_socket, first, 5.0) if sys.argv[2] == "socket" else GrpcStream(stub, [], first)
    try:
        for d in stream.receive():
            pass
        print("ended")
    except StreamBroken as exc:
        print(exc)
"""


@pytest.mark.parametrize("transport", ["socket", "grpc"])
def test_a_rank_of_another_user_cannot_join_a_job_and_lower_its_class(daemon_factory, base, transport):
    """Job ids are names a client chooses; the kernel names the user. Another user's process that registers
    as a rank of a running job, asking for `low`, is refused before it can share the job's grants or lower it:
    on the session socket because the kernel names it as another user, on the gRPC stream because the kernel
    cannot name it at all."""
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover", "--socket-group", str(NOGROUP),
                       socket=base / "run" / "d.sock")
    ident = RankIdentity(job_id="prod-id", job_name="prod", rank=0, local_rank=0, world_size=2, local_size=2,
                         device=0, pid=os.getpid())
    with grpc.insecure_channel(f"unix://{d.socket}") as ch, _session(ch, ident):
        impostor = subprocess.run([sys.executable, "-c", _IMPOSTOR.format(uid=NOBODY, gid=NOGROUP), str(d.socket),
                                   transport], capture_output=True, text=True, timeout=30)
        assert "PERMISSION_DENIED" in impostor.stdout, impostor.stdout + impostor.stderr
        assert {"socket": f"run by uid {os.getuid()}; a rank of uid {NOBODY} cannot join it",
                "grpc": f"run by uid {os.getuid()}, which the session socket vouches for"}[transport] in impostor.stdout
        jobs = pb_grpc.AdminStub(ch).ListJobs(pb.JobsRequest(protocol_version=PROTOCOL_VERSION), timeout=5).jobs
        prod = [j for j in jobs if j.job_name == "prod"]
        assert prod and prod[0].priority == pb.PRIORITY_NORMAL  # not lowered, not even for a moment
    kinds = [e.name for e in d.events() if e.job == "prod-id"]
    assert "job_class" not in kinds, kinds
    assert stops_on_sigterm(d) < 5.0
