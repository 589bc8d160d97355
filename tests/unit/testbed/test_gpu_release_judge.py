"""bench.gpu's pure parts: how the release check judges a run, and the GPU node of the emulated cluster."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu.cli import judge_release, main
from testbed.cluster import ClusterError, ClusterSpec


def test_a_release_after_the_device_work_passes() -> None:
    r = judge_release([1.0, 2.0], [0.5, 1.201, 2.2005], sleep_s=0.2)
    assert r["released_after_device_work"]
    assert r["release_after_launch_ms"] == [201.0, 200.5]


def test_a_release_when_the_cpu_is_done_fails() -> None:
    # One round trip after the launch, while 200 ms of work is still queued on the GPU.
    assert not judge_release([1.0, 2.0], [1.001, 2.2], sleep_s=0.2)["released_after_device_work"]


def test_a_launch_without_a_release_fails() -> None:
    assert not judge_release([1.0, 2.0], [1.3], sleep_s=0.2)["released_after_device_work"]
    assert not judge_release([], [], sleep_s=0.2)["released_after_device_work"]


def test_gpu_nodes_must_exist() -> None:
    assert ClusterSpec(nodes=2, gpu_nodes=(0,)).gpu_nodes == (0,)
    with pytest.raises(ClusterError, match="gpu_nodes"):
        ClusterSpec(nodes=2, gpu_nodes=(2,))


@pytest.mark.parametrize("jobs", ["1", "9"])
def test_a_job_count_outside_2_to_8_is_refused_before_anything_runs(jobs: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", "--jobs", jobs, "--out", str(tmp_path)]) == 2
    assert f"--jobs {jobs}" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()
