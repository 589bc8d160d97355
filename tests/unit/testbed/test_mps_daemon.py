"""bench.lib.mps: the control daemon's lifecycle, with a stand-in for NVIDIA's binary (no GPU here)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bench.lib.mps import MpsDaemon, MpsError

_FAKE = """#!/bin/sh
echo "$0 $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{calls}"
if [ "$1" = "-d" ]; then : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit {rc}; fi
read line; echo "stdin=$line" >> "{calls}"
"""


def _fake(tmp_path: Path, rc: int = 0) -> tuple[str, Path]:
    calls = tmp_path / "calls"
    binary = tmp_path / "bin" / "fake-mps-control"
    binary.parent.mkdir()
    binary.write_text(_FAKE.format(calls=calls, rc=rc))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return str(binary), calls


def test_it_starts_in_the_runs_own_folders_and_quits_once(tmp_path: Path) -> None:
    binary, calls = _fake(tmp_path)
    with MpsDaemon(tmp_path / "run", binary=binary) as mps:
        assert mps.running and (tmp_path / "run" / "mps-pipe" / "control").exists()
        assert mps.env()["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "run" / "mps-pipe")
    mps.stop()  # again: nothing more
    lines = calls.read_text().splitlines()
    assert lines[0].endswith(f"-d pipe={tmp_path}/run/mps-pipe log={tmp_path}/run/mps-log")
    assert lines[1:] == [f"{binary}  pipe={tmp_path}/run/mps-pipe log={tmp_path}/run/mps-log", "stdin=quit"]


def test_a_failed_start_says_why_and_leaves_nothing_running(tmp_path: Path) -> None:
    binary, _ = _fake(tmp_path, rc=3)
    mps = MpsDaemon(tmp_path / "run", binary=binary)
    with pytest.raises(MpsError, match="exited 3"):
        mps.start()
    assert not mps.running


def test_a_missing_binary_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MpsError, match="not on PATH"):
        MpsDaemon(tmp_path, binary=os.fspath(tmp_path / "no-such-mps-control")).start()
