"""bench.sim_vs_gpu: what it reads from a GPU run, that the fit finds the point behind the figures, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim_vs_gpu import fit, main, run_of, simulate_run

_GPU_RUN = Path(__file__).resolve().parents[3] / "results" / "gpu" / "h100_resnet18_b256_i288_x3_rep.json"


def _run(jobs: int) -> dict:
    return {"file": "-", "scenario": f"x{jobs}", "jobs": jobs, "C_s": 0.088, "M_s": 0.082, "cycles": 1,
            "measured": {}}


def test_a_gpu_run_gives_its_layout_phases_and_median_ratios() -> None:
    run = run_of(_GPU_RUN)
    assert (run["jobs"], run["cycles"]) == (3, 9)
    assert run["C_s"] == pytest.approx(0.0881, abs=5e-4) and run["M_s"] == pytest.approx(0.0839, abs=5e-4)
    assert run["measured"] == pytest.approx({"exclusive": 1.0731, "crossover": 1.0685}, abs=1e-3)


def test_the_fit_finds_the_point_that_made_the_figures() -> None:
    runs = [_run(2), _run(3)]
    for r in runs:
        r["measured"] = simulate_run(r, 0.12, 0.004, "fifo", seeds=1, iterations=40)
    result = fit(runs, (0.0, 0.12), (0.3, 4.0), ("fifo", "fair"), seeds=1, iterations=40)
    best = result["best"]
    assert (best["links"], best["switch_penalty"], best["handover_ms"]) == ("fifo", 0.12, 4.0)
    assert best["misses"] == pytest.approx([0.0, 0.0], abs=1e-9)
    assert all(pt["largest_miss"] > 0.01 for pt in result["points"] if pt is not best)


def test_a_reported_run_is_simulated_but_does_not_steer_the_fit() -> None:
    fitted, other = _run(3), _run(2)
    fitted["measured"] = simulate_run(fitted, 0.12, 0.004, "fifo", seeds=1, iterations=40)
    other["measured"] = {"exclusive": 0.5, "crossover": 0.5}  # far from any point
    result = fit([fitted], (0.0, 0.12), (4.0,), ("fifo",), seeds=1, iterations=40, reported=(other,))
    assert result["best"]["switch_penalty"] == 0.12 and result["best"]["largest_miss"] == pytest.approx(0.0, abs=1e-9)
    assert len(result["best"]["predicted"]) == 2 and result["best"]["misses"][1] > 0.4


def test_a_run_without_a_speedup_summary_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "gpu.json"
    bad.write_text(json.dumps({"checks": {"speedup": {"ok": False, "error": "boom"}}}))
    with pytest.raises(ValueError, match="no speed-up summary"):
        run_of(bad)
    assert main([str(bad)]) == 2
    assert "no speed-up summary" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--penalties", ""], ["--handover-ms", "x"], ["--seeds", "0"],
                                   ["--links", "lossy"]])
def test_bad_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(_GPU_RUN), *flags])
    assert exc.value.code == 2


def test_the_command_writes_its_fit(tmp_path: Path) -> None:
    assert main([str(_GPU_RUN), "--penalties", "0.12", "--handover-ms", "4", "--links", "fifo", "--seeds", "1",
                 "--iterations", "40", "--out", str(tmp_path / "fit.json")]) == 0
    written = json.loads((tmp_path / "fit.json").read_text())
    assert written["runs"][0]["jobs"] == 3 and len(written["points"]) == 1
