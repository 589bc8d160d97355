"""Who may do what, tried as a second local user against a real daemon.

The daemon runs as root with --socket-group nogroup; `nobody` (in nogroup) is the
second user: it may look and train through the rank socket, and may not steer
(policy, drain, resume), neither through the CLI nor with a raw gRPC call.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from testbed.harness.daemon import cli, queue_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

NOBODY, NOGROUP = 65534, 65534
AS_USER = Path(__file__).with_name("as_user.py")


def _as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AS_USER), str(NOBODY), str(NOGROUP), *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def shared_daemon(daemon_factory):
    """A daemon whose rank sockets nogroup may reach, in a folder `nobody` can traverse."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user needs root (setuid); run the suite as root to check admin rights")
    base = Path(tempfile.mkdtemp(prefix="crossover-users-", dir="/tmp"))
    base.chmod(0o755)
    d = None
    try:
        d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--socket-group", str(NOGROUP),
                           socket=base / "run" / "d.sock")
        yield d
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_second_user_may_look_and_train_but_not_steer(shared_daemon):
    d = shared_daemon
    sock = str(d.socket)
    modes = {p.name: (stat.S_IMODE(p.stat().st_mode), p.stat().st_gid) for p in d.socket.parent.iterdir()}
    assert modes == {"d.sock": (0o660, NOGROUP), "d.sock.session": (0o660, NOGROUP), "d.sock.admin": (0o600, 0)}
    assert (stat.S_IMODE(d.socket.parent.stat().st_mode), d.socket.parent.stat().st_gid) == (0o750, NOGROUP)

    looked = _as_nobody("cli", "queue", "--json", "--socket", sock)
    assert looked.returncode == 0, looked.stderr
    assert json.loads(looked.stdout)["policy"] == "exclusive"

    trained = _as_nobody("rank", sock)
    assert trained.returncode == 0, trained.stderr
    assert json.loads(trained.stdout) == {"attached": True, "granted": [True, True, True],
                                          "transport": "session socket"}

    for args in (("drain", "0"), ("resume", "0"), ("policy", "passthrough"), ("evict", "0")):
        refused = _as_nobody("cli", *args, "--socket", sock)
        assert refused.returncode == 6, (args, refused.stdout, refused.stderr)
        assert "admin socket" in refused.stderr and "Traceback" not in refused.stderr
    raw = _as_nobody("raw-drain", sock)  # straight to the rank socket, past the CLI
    assert raw.stdout.strip() == "PERMISSION_DENIED", raw.stderr
    state = queue_state(d.socket)
    assert state["policy"] == "exclusive" and [dev["draining"] for dev in state["devices"]] == [False]
    assert not [e for e in d.events() if e.name in ("drain", "resume", "policy")]

    cli("drain", "0", socket=d.socket)  # the daemon's own user steers through the admin socket
    assert [dev["draining"] for dev in queue_state(d.socket)["devices"]] == [True]
