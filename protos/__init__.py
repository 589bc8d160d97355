"""The wire contract `crossover.v1`: the .proto, its generated stubs, the session socket's framing,
and what both ends must agree on: the protocol version, where the sockets are, the token's
metadata key and the largest batch."""
from __future__ import annotations

import os
from pathlib import Path

PROTOCOL_VERSION = 1  # RegisterRequest and every Admin request carry it; the daemon refuses another
STEERING_CALLS = ("SetPolicy", "Drain", "Resume")  # Admin calls that change the daemon: its admin socket only
TOKEN_METADATA_KEY = "x-crossover-token"
MAX_BATCH_EVENTS = 256  # events one BATCH may carry; the daemon refuses a larger one (INVALID_ARGUMENT)


def admin_socket_path(socket_path: str) -> str:
    """The daemon's admin socket beside its rank socket: only its owner (or --admin-group) may connect."""
    return f"{socket_path}.admin"


def default_socket_path() -> str:
    """`$CROSSOVER_SOCKET`, else /run/crossover/crossoverd.sock for root, else a per-user runtime dir."""
    env = os.environ.get("CROSSOVER_SOCKET")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/crossover/crossoverd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/crossover-{os.getuid()}"
    return str(Path(runtime) / "crossover" / "crossoverd.sock")
