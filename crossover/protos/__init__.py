"""The wire contract `crossover.v1`: the .proto, its generated stubs, the session socket's framing,
and what both ends must agree on: the protocol version, where the sockets are, the token's
metadata key and the largest batch."""
from __future__ import annotations

import os
from pathlib import Path

PROTOCOL_VERSION = 2  # RegisterRequest and every Admin request carry it; the daemon refuses another
# Admin calls that change the daemon: its admin socket only
STEERING_CALLS = ("SetPolicy", "Drain", "Resume", "Evict", "SetJobClass")
# The `crossover` commands that make them, as every help text and docs/cli.md list them
STEERING_COMMANDS = ("policy NAME", "drain", "resume", "evict", "priority", "share")
STEERING_COMMANDS_TEXT = ", ".join(STEERING_COMMANDS[:-1]) + " and " + STEERING_COMMANDS[-1]
TOKEN_METADATA_KEY = "x-crossover-token"
USER_METADATA_KEY = "x-crossover-user"  # who the CLI says runs it: recorded with every steering call, not trusted
POLICIES = {
    "crossover": "the default: one job's compute phase per device at a time, served in the order jobs' "
                 "allreduces ended (one order on every node), clearly shorter computes first",
    "exclusive": "FIFO: one job's compute phase per device at a time, in the order ranks asked",
    "passthrough": "observe and record only; never blocks",
}
"""The names `SetPolicy` takes (`crossoverd --policy`, `crossover policy NAME`), each with what it does."""
MAX_BATCH_EVENTS = 256  # events one BATCH may carry; the daemon refuses a larger one (INVALID_ARGUMENT)


def admin_socket_path(socket_path: str) -> str:
    """The daemon's admin socket beside its rank socket: only its owner (or --admin-group) may connect."""
    return f"{socket_path}.admin"


SYSTEM_SOCKET = "/run/crossover/crossoverd.sock"


def default_socket_path(client: bool = False) -> str:
    """`$CROSSOVER_SOCKET`, else /run/crossover/crossoverd.sock for root, else a per-user runtime dir.

    With `client` (ranks, the CLI), a user with no daemon of their own finds the node's
    system daemon (deploy/systemd) at /run/crossover/crossoverd.sock; a daemon never
    takes that path unless it runs as root or is told to.
    """
    return os.environ.get("CROSSOVER_SOCKET") or node_socket_path(client)


def node_socket_path(client: bool = False) -> str:
    """Where the node's daemon listens when `CROSSOVER_SOCKET` does not say: `default_socket_path` without the
    variable, for a rank whose settings (`crossover.settings`) have read it already."""
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/crossover-{os.getuid()}"
    own = Path(runtime) / "crossover" / "crossoverd.sock"
    if client and not own.exists() and Path(SYSTEM_SOCKET).exists():
        return SYSTEM_SOCKET
    return str(own)
