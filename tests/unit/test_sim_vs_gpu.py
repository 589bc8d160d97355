"""bench.sim_vs_gpu: the fit finds the device point that produced the figures, and refuses a run without them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim_vs_gpu import fit, main, run_of, simulate_run

_GPU_RUN = Path(__file__).resolve().parents[2] / "results" / "gpu" / "h100_resnet18_b256_i288_x3_rep.json"


def _run(jobs: int) -> dict:
    return {"file": "-", "scenario": f"x{jobs}", "jobs": jobs, "C_s": 0.088, "M_s": 0.082, "measured": {}}


def test_the_fit_finds_the_point_that_made_the_figures() -> None:
    runs = [_run(2), _run(3)]
    for r in runs:
        r["measured"] = simulate_run(r, 0.12, 0.004, seeds=1, iterations=40)
    result = fit(runs, (0.0, 0.12), (0.3, 4.0), seeds=1, iterations=40)
    assert (result["best"]["switch_penalty"], result["best"]["handover_ms"]) == (0.12, 4.0)
    assert result["best"]["largest_miss"] == pytest.approx(0.0, abs=1e-9)
    assert all(pt["largest_miss"] > 0.01 for pt in result["points"] if pt is not result["best"])


def test_time_slicing_without_a_cost_gives_blocking_no_gain_with_three_jobs() -> None:
    assert simulate_run(_run(3), 0.0, 0.0003, seeds=1, iterations=40)["exclusive"] < 1.0


def test_a_run_without_a_speedup_summary_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "gpu.json"
    bad.write_text(json.dumps({"checks": {"speedup": {"ok": False, "error": "boom"}}}))
    with pytest.raises(ValueError, match="no speed-up summary"):
        run_of(bad)
    assert main([str(bad)]) == 2
    assert "no speed-up summary" in capsys.readouterr().err


def test_a_committed_gpu_run_reads_and_fits(tmp_path: Path) -> None:
    run = run_of(_GPU_RUN)
    assert run["jobs"] == 3 and 0.08 < run["C_s"] < 0.1
    assert main([str(_GPU_RUN), "--penalties", "0.12", "--handover-ms", "4", "--seeds", "1", "--iterations", "40",
                 "--out", str(tmp_path / "fit.json")]) == 0
    assert json.loads((tmp_path / "fit.json").read_text())["best"]["switch_penalty"] == 0.12
