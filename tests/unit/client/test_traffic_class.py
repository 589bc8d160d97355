"""A low-class rank marks its TCP sockets lower effort (DSCP), and unmarks them when its class rises."""
from __future__ import annotations

import socket

import pytest

from crossover.client.rank.traffic_class import TrafficMark, mark_tcp_sockets


@pytest.fixture
def tcp_pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    yield client, peer, server, udp
    for s in (client, peer, server, udp):
        s.close()


def _dscp(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) >> 2


def test_every_tcp_socket_of_the_process_is_marked_and_nothing_else(tcp_pair):
    client, peer, server, udp = tcp_pair
    assert mark_tcp_sockets(8) >= 3
    assert [_dscp(s) for s in (client, peer, server)] == [8, 8, 8]
    assert _dscp(udp) == 0
    client.sendall(b"still open")  # the marking handles were second handles: closing them closed nothing
    assert peer.recv(10) == b"still open"
    mark_tcp_sockets(0)
    assert [_dscp(s) for s in (client, peer, server)] == [0, 0, 0]


def test_a_dscp_outside_six_bits_is_refused():
    with pytest.raises(ValueError, match="0..63"):
        mark_tcp_sockets(64)


def test_the_mark_follows_the_class(tcp_pair):
    client = tcp_pair[0]
    mark = TrafficMark(low_dscp=8)
    mark.follow("normal")  # never low: nothing touched
    assert _dscp(client) == 0 and not mark.marked
    mark.follow("low")
    assert _dscp(client) == 8 and mark.marked
    mark.follow("high")
    assert _dscp(client) == 0 and not mark.marked
    off = TrafficMark(low_dscp=0)  # CROSSOVER_LOW_DSCP=0: low, unmarked
    off.follow("low")
    assert _dscp(client) == 0 and not off.marked
