"""A low-class rank's network traffic marked lower effort, so a network that honours DSCP serves others first.

The classes keep a production job's compute phases whole on a shared device, but its allreduce also
crosses the node's link, which a low job's allreduce shares: on the H200 the production job's allreduce
grew from 72 to 113 ms beside one low job while its compute stayed whole (docs/gpu.md). The daemon cannot
order packets; the network can, if it knows which are which. So while its job is `low`, a rank sets the
DSCP of every TCP socket it holds (Horovod's Gloo and controller connections among them) to
`CROSSOVER_LOW_DSCP` (8, CS1: the "lower effort" code point operators already use for scavenger
traffic), and back to 0 when its class rises. A node qdisc or a switch that maps that code point to a
lower band then sends the production job's bytes first; a network that ignores DSCP changes nothing.

Sockets made after the mark (an elastic reset's new rings) are marked at the rank's next attach or class
change.
"""
from __future__ import annotations

import logging
import os
import socket
import stat

__all__ = ["TrafficMark", "mark_tcp_sockets"]

_log = logging.getLogger("crossover.traffic")


def _tcp_socket(fd: int) -> socket.socket | None:
    """A second handle on `fd` if it is a TCP socket over IP (closing it leaves `fd` open), else None."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        return sock
    sock.close()
    return None


def mark_tcp_sockets(dscp: int) -> int:
    """Give every TCP socket this process holds the DSCP code point `dscp` (0..63); how many it marked.

    The two ECN bits of the traffic-class byte stay the kernel's. A socket that refuses (closed meanwhile)
    is skipped."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP {dscp}: must be within 0..63")
    marked = 0
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        sock = _tcp_socket(fd)
        if sock is None:
            continue
        try:
            if sock.family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)
                try:  # an IPv4-mapped peer's packets take IP_TOS
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
                except OSError:
                    pass
            else:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
            marked += 1
        except OSError as exc:
            _log.debug("crossover: could not mark socket %d: %s", fd, exc)
        finally:
            sock.close()
    return marked


class TrafficMark:
    """A rank's mark as its class changes: `low_dscp` on every TCP socket while the class is low (again at each
    word of it, for sockets made since), 0 once it rises; nothing for a rank never low, or `low_dscp` 0."""

    def __init__(self, low_dscp: int) -> None:
        self.low_dscp = low_dscp
        self.marked = False

    def follow(self, class_name: str) -> None:
        dscp = self.low_dscp if class_name == "low" else 0
        if dscp == 0 and not self.marked:
            return
        count = mark_tcp_sockets(dscp)
        self.marked = dscp != 0
        _log.info("crossover: %d TCP sockets of this rank now carry DSCP %d", count, dscp)
