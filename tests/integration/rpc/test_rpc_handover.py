"""The hand-over on the device through a real in-process daemon, real client sessions on its session socket
and the emulated device's server: the next rank's work starts as the holder's ends with no CPU between
them, a holder that is gone cannot strand it, and a rank can neither write another's page nor resize its own."""
from __future__ import annotations

import fcntl
import mmap
import os
import time

import pytest

from crossover.client.rank.session import Session
from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import crossover_v1_pb2_grpc as pb_grpc
from crossover.protos.event_file import Event, EventName
from crossover.protos.event_records import Grant, HandoverRescue
from testbed.device_model.turns import ModelTurns
from tests.integration.rpc._world import wait_for
from tests.unit.testbed.test_device_model_streams import Bed, bed  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ranks(bed: Bed, sessions):  # noqa: F811 (the imported fixture)
    """`make(target, job, handover=True, device=True)` → an attached session whose device is the bed's (handed
    to the session unless `device` is False), closed at teardown."""
    def make(target: str, job: str, handover: bool = True, device: bool = True) -> tuple[Session, ModelTurns]:
        s = sessions(target, job, lease=False, handover=handover)
        wait_for(lambda: s.attached)
        turns = ModelTurns(bed.connect())
        if device and handover:
            wait_for(lambda: s.turns._own is not None)  # its page came on the receiving thread
        if device:
            s.use_device(turns)  # this thread maps it
        return s, turns

    return make


def _events(d, name: EventName) -> list[Event]:
    return [e for e in map(Event.from_json, d.core.events.snapshot()) if e is not None and e.name is name]


def _ready_pair(serve, ranks, first: str, second: str, policy: str = "exclusive"):
    """A daemon and two ranks on one device, both ending their turns on it."""
    d = serve(policy=policy, lease=False)
    target = f"unix://{d.socket_path}"
    pair = ranks(target, first), ranks(target, second)
    wait_for(lambda: all(s.hands_over for s, _ in pair))
    return d, pair


def _turn_owed(rank: Session, device: ModelTurns, work_s: float) -> None:
    """The rank takes its turn, queues `work_s` of device work and ends the turn before the device has done it."""
    assert rank.acquire(0)
    device.client.submit(work_s)
    rank.release(0, ticket=rank.end_turn())


def test_the_next_ranks_work_starts_on_the_device_as_the_holders_ends(serve, ranks):
    d, ((a, dev_a), (b, dev_b)) = _ready_pair(serve, ranks, "first", "second")
    assert {e.job_name for e in _events(d, EventName.HANDOVER)} == {"first", "second"}
    start = time.monotonic()
    _turn_owed(a, dev_a, 0.3)  # ended at once: the device has 0.3 s of A's work left
    assert b.acquire(0)
    granted = time.monotonic() - start
    dev_b.client.submit(0.05)
    dev_b.drain()
    done = time.monotonic() - start
    assert granted < 0.2, f"B's grant waited for A's device ({granted:.3f} s)"
    assert done >= 0.34, f"B's work ran beside A's instead of after it ({done:.3f} s)"
    grant = [e for e in _events(d, EventName.GRANT) if e.job_name == "second"][-1]
    assert Grant.of(grant).after == 1  # the event log says whose ticket B's device waited for
    dev_a.drain()


def test_a_holder_that_is_gone_cannot_strand_the_rank_after_it(serve, ranks):
    d, ((a, dev_a), (b, dev_b)) = _ready_pair(serve, ranks, "doomed", "next")
    _turn_owed(a, dev_a, 30.0)
    assert b.acquire(0)
    dev_a.client.close()  # the holder's process dies: its device work and its ticket go with it
    start = time.monotonic()
    a.close()
    dev_b.client.submit(0.01)
    dev_b.drain()
    assert time.monotonic() - start < 2.0
    rescue = _events(d, EventName.HANDOVER_RESCUE)
    assert len(rescue) == 1 and rescue[0].job_name == "doomed" and HandoverRescue.of(rescue[0]).ticket == 1


def test_a_rank_cannot_write_the_page_it_waits_on_or_resize_its_own(serve, ranks):
    _, ((a, dev_a), (b, dev_b)) = _ready_pair(serve, ranks, "one", "two")
    _turn_owed(a, dev_a, 0.05)
    assert b.acquire(0)
    peers = b.turns._peers
    assert len(peers) == 1
    (peer_fd,) = peers.values()
    with pytest.raises(PermissionError):
        mmap.mmap(peer_fd, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    reopened = os.open(f"/proc/self/fd/{peer_fd}", os.O_RDWR)  # the inode is 0777: the seal is what stops it
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(reopened, 4096)
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"\xff\xff\xff\xff", 0)
    finally:
        os.close(reopened)
    own = b.turns._own
    assert own is not None
    with pytest.raises(PermissionError):
        os.ftruncate(own, 0)
    seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SEAL and seals & fcntl.F_SEAL_SHRINK and seals & 0x0010  # F_SEAL_FUTURE_WRITE
    dev_b.drain()


def test_one_rank_without_the_hand_over_keeps_the_whole_device_on_the_usual_path(serve, channels, ranks):
    d = serve(policy="exclusive", lease=False)
    target = f"unix://{d.socket_path}"
    (a, _), (b, _) = ranks(target, "able"), ranks(target, "plain", handover=False)
    wait_for(lambda: a.turns.ready)
    time.sleep(0.2)
    assert not a.hands_over and not b.hands_over and not b.turns.ready
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    state = admin.GetQueue(pb.QueueRequest(protocol_version=PROTOCOL_VERSION, device=0), timeout=5)
    paths = {r.job_name: r.handover for r in (*state.devices[0].holders, *state.devices[0].waiting,
                                                 *state.devices[0].others)}
    assert paths == {"able": "device", "plain": ""}
    b.close()
    wait_for(lambda: a.hands_over)  # alone with ranks that can, the device hands over again


def test_a_ticket_from_a_rank_whose_page_is_not_sealed_is_not_owed_and_its_page_goes_to_nobody(serve, ranks):
    d = serve(policy="exclusive", lease=False)
    target = f"unix://{d.socket_path}"
    (honest, dev), (sly, _) = ranks(target, "honest"), ranks(target, "sly", device=False)
    wait_for(lambda: sly.turns._own is not None)  # it has a page, but never said its device mapped it
    assert sly.acquire(0)
    sly.release(0, ticket=7)  # claims its device owes a ticket
    assert honest.acquire(0)
    assert honest.turns._peers == {} and [e for e in _events(d, EventName.GRANT) if Grant.of(e).after] == []
    dev.drain()


def test_where_jobs_classes_differ_turns_end_on_the_cpu_and_priorities_see_device_time(serve, channels, ranks):
    d, ((prod, _), (sweep, _)) = _ready_pair(serve, ranks, "prod", "sweep", policy="crossover")
    admin = pb_grpc.AdminStub(channels(f"unix://{d.admin_socket}"))
    admin.SetJobClass(pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="sweep", priority=pb.PRIORITY_LOW),
                      timeout=5)
    wait_for(lambda: not prod.hands_over and not sweep.hands_over)
    admin.SetJobClass(pb.JobClassRequest(protocol_version=PROTOCOL_VERSION, job="sweep",
                                         priority=pb.PRIORITY_NORMAL), timeout=5)
    wait_for(lambda: prod.hands_over and sweep.hands_over)
