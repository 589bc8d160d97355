"""The way to a node's daemon, for both of its sides: a rank's session and the operator's `crossover` command.

A channel to a daemon's socket or TCP address with the metadata its calls carry, and the two checks made
before a Unix socket is used: that it exists (no socket: no daemon on this node), and that it can be the
node's daemon's (not another user's socket in its place). Neither side's settings are needed here.
"""
from __future__ import annotations

import os
import pwd
import stat

import grpc

from crossover.protos import TOKEN_METADATA_KEY

__all__ = ["channel_for", "missing_socket", "untrusted_socket"]


def channel_for(target: str, token: str = "", tls_ca: str = "") -> tuple[grpc.Channel, list[tuple[str, str]]]:
    """A channel to a daemon (`unix:///path` or `host:port`) and the metadata every call must carry."""
    metadata = [(TOKEN_METADATA_KEY, token)] if token else []
    if tls_ca and not target.startswith("unix:"):
        with open(tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(target, creds), metadata
    return grpc.insecure_channel(target), metadata


def _unix_path(target: str) -> str:
    """The path of a `unix:` or `unix://` target; "" for any other (TCP)."""
    if not target.startswith("unix:"):
        return ""
    return target[len("unix://"):] if target.startswith("unix://") else target[len("unix:"):]


def missing_socket(target: str) -> str:
    """The path of a Unix-socket target that does not exist ("" otherwise).

    No socket file means no daemon on this node: say so at once instead of
    spending the connect timeout, which is meant for a daemon that is there but busy.
    """
    path = _unix_path(target)
    return "" if not path or os.path.exists(path) else path


def untrusted_socket(target: str, daemon_user: str) -> str:
    """Why a Unix-socket target cannot be the node's daemon ("" when it can, or when it is no socket path).

    A daemon's socket belongs to root, to this user (a daemon of one's own), to `daemon_user`
    (`CROSSOVER_DAEMON_USER`, read by the caller's settings), or to the owner of its folder where only root
    could have made that folder theirs (its parent is root's and no one else may write there, as with
    /run/crossover). Anything else is another user's socket in the daemon's place: talking to it would hand
    them this rank's phases or this operator's commands.
    """
    path = _unix_path(target)
    if not path:
        return ""
    try:
        st = os.stat(path)
        folder = os.stat(os.path.dirname(os.path.abspath(path)))
        parent = os.stat(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    except OSError:
        return ""
    trusted = {0, os.geteuid()}
    if daemon_user:
        try:
            trusted.add(pwd.getpwnam(daemon_user).pw_uid)
        except KeyError:
            return f"CROSSOVER_DAEMON_USER={daemon_user}: no such user"
    if parent.st_uid == 0 and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        trusted.add(folder.st_uid)
    if st.st_uid in trusted:
        return ""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (f"{path} belongs to {owner}, not to root, this user or the daemon's user: refusing to use it "
            "(set CROSSOVER_DAEMON_USER to the user crossoverd runs as)")
