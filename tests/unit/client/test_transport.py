"""The session socket's client side against a hand-made peer: framing, errors, and never blocking training."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from crossover.client.rank.transport import FrameStream, StreamBroken
from crossover.protos import crossover_v1_pb2 as pb
from crossover.protos import framing

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def peer(tmp_path):
    """A listening Unix socket standing in for the daemon; yields (path, accept())."""
    path = str(tmp_path / "s.session")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    accepted: list[socket.socket] = []

    def accept() -> socket.socket:
        srv.settimeout(5)
        conn, _ = srv.accept()
        accepted.append(conn)
        return conn

    yield path, accept
    for c in accepted:
        c.close()
    srv.close()


def read_frame(conn: socket.socket) -> pb.RankEvent:
    conn.settimeout(5)
    header = conn.recv(4, socket.MSG_WAITALL)
    ev = pb.RankEvent()
    ev.ParseFromString(conn.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL))
    return ev


def test_frames_survive_being_cut_anywhere_and_an_error_frame_ends_the_stream(peer):
    path, accept = peer
    stream = FrameStream(path, pb.RankEvent(kind=pb.OPEN, session_id="s1"), timeout_s=2)
    conn = accept()
    assert read_frame(conn).session_id == "s1"
    stream.send(pb.RankEvent(kind=pb.COMPUTE_REQUEST, seq=7))
    assert read_frame(conn).seq == 7
    data = (framing.encode(pb.Directive(grant=pb.Grant(seq=7, iteration=3)))
            + framing.encode(pb.Directive(lease=pb.Lease(held=True)))
            + framing.encode(pb.Directive(error=pb.SessionError(code="NOT_FOUND", message="gone"))))

    def dribble() -> None:  # one byte at a time: every frame boundary falls inside a recv
        for i in range(len(data)):
            conn.sendall(data[i:i + 1])
            time.sleep(0.001)

    threading.Thread(target=dribble, daemon=True).start()
    got = []
    with pytest.raises(StreamBroken, match="NOT_FOUND: gone"):
        for d in stream.receive():
            got.append(d.WhichOneof("kind"))
    assert got == ["grant", "lease"]
    stream.dispose()


def test_a_clean_close_ends_receive_and_a_torn_frame_is_an_error(peer):
    path, accept = peer
    first = FrameStream(path, pb.RankEvent(kind=pb.OPEN, session_id="a"), timeout_s=2)
    conn = accept()
    read_frame(conn)  # a peer that closes with unread data resets the connection instead
    conn.sendall(framing.encode(pb.Directive(grant=pb.Grant(seq=1))))
    conn.close()
    assert [d.grant.seq for d in first.receive()] == [1]
    first.dispose()

    second = FrameStream(path, pb.RankEvent(kind=pb.OPEN, session_id="b"), timeout_s=2)
    conn = accept()
    read_frame(conn)
    conn.sendall(framing.encode(pb.Directive(grant=pb.Grant(seq=2)))[:5])
    conn.close()
    with pytest.raises(StreamBroken, match="inside a frame"):
        list(second.receive())
    second.dispose()


def test_sending_never_waits_for_a_daemon_that_stopped_reading(peer):
    path, accept = peer
    stream = FrameStream(path, pb.RankEvent(kind=pb.OPEN, session_id="s"), timeout_s=2)
    accept()  # and never read again

    def drain() -> None:
        try:
            list(stream.receive())
        except StreamBroken:
            pass

    receiving = threading.Thread(target=drain, daemon=True)
    receiving.start()
    big = pb.RankEvent(kind=pb.BATCH, batch=[pb.RankEvent(kind=pb.COMPUTE_DONE, iteration=i) for i in range(200)])
    slowest = 0.0
    with pytest.raises(StreamBroken, match="stopped reading"):
        for _ in range(100_000):
            t0 = time.monotonic()
            try:
                stream.send(big)
            finally:
                slowest = max(slowest, time.monotonic() - t0)
    assert slowest < 0.5
    receiving.join(5)  # giving up on the stream also ends the receiving thread's wait
    assert not receiving.is_alive()
    with pytest.raises(StreamBroken):
        stream.send(pb.RankEvent(kind=pb.HEARTBEAT))
    stream.dispose()


def test_frame_limits():
    assert framing.frame_length(struct.pack(">I", framing.MAX_FRAME)) == framing.MAX_FRAME
    with pytest.raises(framing.FrameError, match="limit"):
        framing.frame_length(struct.pack(">I", framing.MAX_FRAME + 1))
    huge = pb.RankEvent(kind=pb.OPEN, session_id="x" * (framing.MAX_FRAME + 1))
    with pytest.raises(framing.FrameError, match="exceeds"):
        framing.encode(huge)


def test_no_socket_is_an_os_error_the_session_falls_back_on(tmp_path):
    with pytest.raises(OSError):
        FrameStream(str(tmp_path / "missing"), pb.RankEvent(kind=pb.OPEN, session_id="s"), timeout_s=1)
