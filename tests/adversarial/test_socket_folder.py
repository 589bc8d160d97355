"""No member of the socket group can stand in for the daemon, and no other user's socket is taken for it.

Before: the socket folder was 0770, so `nobody` in the socket group could rename
`crossoverd.sock.admin` (or a rank socket) and bind its own in its place, seeing
other users' ranks and the operator's steering calls; clients took any socket
at their path, whoever owned it; and a second daemon on the same socket took
it over from a live one. Now the folder is 0750 (the group reaches the sockets,
only the daemon changes them), clients refuse a socket owned by anyone but root,
themselves or the daemon's user, and a daemon refuses a socket another answers on.
"""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from attack_bed import NOBODY, NOGROUP, answers_within, drop_to_nobody, grant_waits, start_victim, stops_on_sigterm

from testbed.harness.daemon import BIN, DaemonProc

pytestmark = [pytest.mark.multiprocess, pytest.mark.adversarial, pytest.mark.timeout(180)]

def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, preexec_fn=drop_to_nobody)


def test_a_socket_group_member_cannot_replace_the_daemons_sockets(daemon_factory, jobs, base, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "exclusive", "--socket-group", str(NOGROUP),
                       socket=base / "run" / "d.sock")
    folder = d.socket.parent
    victim = start_victim(d, tmp_path)
    jobs.append(victim)
    for sock in ("d.sock", "d.sock.admin", "d.sock.session"):
        moved = _as_nobody("/bin/mv", str(folder / sock), str(folder / f"{sock}.mine"))
        assert moved.returncode != 0 and "Permission denied" in moved.stderr, (sock, moved.stderr)
        planted = _as_nobody("/bin/sh", "-c", f"echo > {folder / (sock + '.x')}")
        assert planted.returncode != 0 and "Permission denied" in planted.stderr, (sock, planted.stderr)
    assert sorted(p.name for p in folder.iterdir()) == ["d.sock", "d.sock.admin", "d.sock.session"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750 and folder.stat().st_gid == NOGROUP
    assert answers_within(d, 1.0) < 1.0
    assert victim.wait(120) == 0, victim.output()[-3000:]
    assert grant_waits(d, "victim")
    assert stops_on_sigterm(d) < 5.0


def _fake_daemon_socket(path: Path) -> socket.socket:
    """A socket listening on `path` that belongs to `nobody`, as a fake daemon's would."""
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(path))
    fake.listen(8)
    os.chown(path, NOBODY, NOGROUP)
    return fake


def test_clients_refuse_another_users_socket_in_the_daemons_place(base, tmp_path):
    folder = base / "shared"
    folder.mkdir(mode=0o1777)
    folder.chmod(0o1777)  # like /tmp: anyone may create a socket here
    fake_path = folder / "crossoverd.sock"
    fake = _fake_daemon_socket(fake_path)
    try:
        assert fake_path.stat().st_uid == NOBODY
        cli = subprocess.run([str(BIN / "crossover"), "queue", "--socket", str(fake_path)], capture_output=True,
                             text=True, timeout=30)
        assert cli.returncode == 6, cli.stderr  # FORBIDDEN, said in one line
        assert "belongs to nobody" in cli.stderr and "CROSSOVER_DAEMON_USER" in cli.stderr
        assert "Traceback" not in cli.stderr
        # A rank refuses it too, and trains on (unscheduled) instead of hanging or talking to it.
        rank = subprocess.run(
            [sys.executable, "-c", "from crossover.client.rank.session import Session; "
             "from crossover.settings import PluginSettings; "
             "from crossover.protos.identity import RankIdentity; import os; "
             "s = Session(RankIdentity('j', 'j', 0, 0, 1, 1), PluginSettings.from_env('x')).start(); "
             "print('attached' if s.attached else 'refused')"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "CROSSOVER_SOCKET": str(fake_path), "CROSSOVER_LOG_LEVEL": "WARNING"})
        assert rank.stdout.strip() == "refused", rank.stdout + rank.stderr
        assert "belongs to nobody" in rank.stderr and "checks the socket again every 2 s" in rank.stderr
        # Naming the fake's owner as the daemon's user is the operator's explicit choice.
        named = subprocess.run([str(BIN / "crossover"), "queue", "--socket", str(fake_path), "--timeout", "1"],
                               capture_output=True,
                               text=True, timeout=30, env={**os.environ, "CROSSOVER_DAEMON_USER": "nobody"})
        assert "belongs to nobody" not in named.stderr
    finally:
        fake.close()


def test_a_second_daemon_does_not_take_a_live_daemons_socket(daemon_factory, tmp_path):
    first = daemon_factory("--cpu-devices", "1", name="first")
    second = subprocess.run([str(BIN / "crossoverd"), "--socket", str(first.socket), "--cpu-devices", "1"],
                            capture_output=True, text=True, timeout=30)
    assert second.returncode != 0 and f"another crossoverd (pid {first.pid}) serves" in second.stderr, \
        second.stderr[-2000:]
    assert answers_within(first, 1.0) < 1.0  # the first still serves its socket
    first.proc.kill()  # a daemon SIGKILLed leaves its socket behind: stale, and taken over
    first.proc.wait()
    assert _connect_refused(first.socket)
    third = DaemonProc(socket=first.socket, event_log=tmp_path / "third.jsonl", log=tmp_path / "third.log",
                       args=["--cpu-devices", "1"]).start()
    try:
        assert answers_within(third, 1.0) < 1.0
    finally:
        third.kill()


def _connect_refused(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(path))
        return False
    except ConnectionRefusedError:
        return True
    finally:
        s.close()
