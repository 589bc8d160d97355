"""Float32 buffers in `/dev/shm` that one process makes and others on its node map.

Two users: a group leader offers the parameter service three buffers its
exchanges move through (`link`), and a leader whose whole group is on its node
hands the model to its members through one (`handoff`). The maker describes
each buffer by path, device and inode; a process that maps it checks it is
that very file, and the maker unlinks the names once every peer has mapped
them, so nothing is left behind if any of them dies.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SHM_DIR", "SharedBuffers", "map_described", "shared_memory_usable"]

SHM_DIR = Path("/dev/shm")


def shared_memory_usable() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedBuffers:
    """``count`` buffers of ``numel`` float32 values each, made here (raises ``OSError`` where they cannot be)."""

    def __init__(self, numel: int, count: int, prefix: str) -> None:
        self.paths: list[str] = []
        self.arrays: list[np.ndarray] = []
        try:
            for _ in range(count):
                fd, path = tempfile.mkstemp(prefix=prefix, dir=SHM_DIR)
                self.paths.append(path)
                try:
                    os.ftruncate(fd, max(1, numel * 4))
                    mm = mmap.mmap(fd, max(1, numel * 4))
                finally:
                    os.close(fd)
                self.arrays.append(np.frombuffer(mm, dtype=np.float32, count=numel))
        except OSError:
            self.unlink()
            raise

    def describe(self) -> list[dict[str, Any]]:
        """What a peer needs to map them (`map_described`)."""
        out = []
        for path in self.paths:
            st = os.stat(path)
            out.append({"path": path, "dev": st.st_dev, "ino": st.st_ino})
        return out

    def unlink(self) -> None:
        """Remove the names; every mapping made so far stays valid."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def map_described(described: list[dict[str, Any]], numel: int) -> list[np.ndarray]:
    """The buffers `SharedBuffers.describe` described, each checked to be the very file made (device and
    inode); ``ValueError`` for one that is not, ``OSError`` for one that cannot be opened."""
    arrays = []
    for one in described:
        path = str(one["path"])
        with open(path, "r+b") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != (int(one["dev"]), int(one["ino"])) or st.st_size < numel * 4:
                raise ValueError(f"{path} is not the buffer offered")
            mm = mmap.mmap(f.fileno(), max(1, numel * 4))
        arrays.append(np.frombuffer(mm, dtype=np.float32, count=numel))
    return arrays
