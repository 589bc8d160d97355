"""`crossover stats` and `crossover timeline` on event logs written by the daemon's own `EventLog`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossover.client.cli import main
from crossover.daemon.event_log import EventLog
from crossover.protos.event_records import (
    CommBegin,
    CommEnd,
    Drain,
    Grant,
    Leave,
    Policy,
    RankTag,
    Record,
    Register,
    Release,
    Request,
)

ALPHA = "a1a1a1a1a1a1a1a1"
BETA = "b2b2b2b2b2b2b2b2"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_node(path: Path, node: str, rank: int, clock_base: float, beta_name: str = "beta") -> Path:
    """Ten iterations of two jobs sharing device 0, as one daemon logs them; `clock_base` is that daemon's
    monotonic clock at the first event (each node's differs), the wall clock is shared."""
    log = EventLog(path=path, clock=lambda: clock_base + 100.0, wall_clock=lambda: 1_700_000_100.0,
                   flush_interval_s=60)

    def rec(t: float, job: str, record: Record) -> None:
        log.record(record, t=clock_base + t, about=RankTag(job=job, job_name="alpha" if job == ALPHA else beta_name,
                                                           rank=rank, device=0, node=node))

    rec(0.0, ALPHA, Register(pid=1, world_size=2))
    rec(0.0, BETA, Register(pid=2, world_size=2))
    for i in range(10):
        # alpha: no wait, compute 0.5 s, allreduce 0.5 s; beta: waits 0.25 s for alpha, compute 0.5, allreduce 0.25
        rec(i, ALPHA, Request(iteration=i, seq=i + 1))
        rec(i, ALPHA, Grant(iteration=i, waited_s=0.0))
        rec(i + 0.25, BETA, Request(iteration=i, seq=i + 1))
        rec(i + 0.5, ALPHA, Release(held_s=0.5))
        rec(i + 0.5, ALPHA, CommBegin(iteration=i))
        rec(i + 0.5, BETA, Grant(iteration=i, waited_s=0.25))
        rec(i + 1.0, ALPHA, CommEnd(iteration=i, duration_s=0.5))
        rec(i + 1.0, BETA, Release(held_s=0.5))
        rec(i + 1.0, BETA, CommBegin(iteration=i))
        rec(i + 1.25, BETA, CommEnd(iteration=i, duration_s=0.25))
    rec(10.5, ALPHA, Leave(reason="stream ended"))
    rec(10.5, BETA, Leave(reason="stream ended"))
    log.record(Policy(old="crossover", new="exclusive", caller=""), t=clock_base + 10.5)
    log.close()
    return path


@pytest.fixture
def logs(tmp_path: Path) -> list[str]:
    return [str(_write_node(tmp_path / "n0.jsonl", "n0", 0, 1000.0)),
            str(_write_node(tmp_path / "n1.jsonl", "n1", 1, 5000.0))]


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_stats_json_has_each_job_and_device(logs):
    res = _run("stats", *logs, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["version"] == 2 and data["kind"] == "stats"
    assert data["window"] == {"since_s": 0.0, "until_s": 10.5, "log_s": 10.5}
    jobs = {j["job_name"]: j for j in data["jobs"]}
    alpha, beta = jobs["alpha"], jobs["beta"]
    assert alpha["job_id"] == ALPHA and alpha["ranks"] == [0, 1]
    assert alpha["iterations"] == beta["iterations"] == 10
    assert alpha["compute_total_s"] == pytest.approx(10.0) and alpha["compute_mean_s"] == pytest.approx(0.5)
    assert alpha["comm_mean_s"] == pytest.approx(0.5) and beta["comm_mean_s"] == pytest.approx(0.25)
    assert alpha["wait_max_s"] == 0.0
    assert beta["wait_total_s"] == pytest.approx(5.0) and beta["wait_p95_s"] == pytest.approx(0.25)
    devices = {(d["node"], d["device"]): d for d in data["devices"]}
    assert set(devices) == {("n0", 0), ("n1", 0)}
    for d in devices.values():
        assert d["busy_fraction"] == pytest.approx(10.0 / 10.5), "the two nodes' clocks are aligned"
        assert d["grants"] == 20
    assert devices[("n1", 0)]["holders"] == ["alpha/1", "beta/1"]


def test_a_file_named_twice_is_read_once(logs):
    once = json.loads(_run("stats", *logs, "--json").stdout)
    assert json.loads(_run("stats", *logs, logs[0], "--json").stdout) == once


def test_stats_in_a_window_for_one_job(logs):
    res = _run("stats", *logs, "--json", "--since", "2", "--until", "8", "--job", "beta")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [j["job_name"] for j in data["jobs"]] == ["beta"]
    assert data["jobs"][0]["iterations"] == 6
    assert data["devices"][0]["busy_fraction"] == pytest.approx(0.5)
    res = _run("stats", *logs, "--json", "--since", "-1", "--job", BETA[:8])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["window"]["since_s"] == pytest.approx(9.5)


def test_stats_table(logs):
    res = _run("stats", *logs)
    assert res.exit_code == 0, res.output
    assert "alpha" in res.stdout and "beta" in res.stdout and "a1a1a1a1a1a1" in res.stdout
    assert re.search(r"n1\s.*\s95%\s.*\s20\s.*alpha/1, beta/1", res.stdout)


def test_timeline_refuses_a_folder_that_does_not_exist_and_creates_none(logs, tmp_path):
    out = tmp_path / "nonexistent" / "x.png"
    res = _run("timeline", *logs, "-o", str(out))
    assert res.exit_code == 2 and "does not exist" in res.stderr
    assert not out.parent.exists()


def test_policy_help_lists_every_policy_the_daemon_has():
    from crossover.daemon import policies
    from crossover.protos import POLICIES

    assert sorted(POLICIES) == policies.available()
    res = _run("policy", "--help")
    assert res.exit_code == 0
    assert all(f"\n  {name} " in res.stdout for name in POLICIES), res.stdout
    assert max(map(len, res.stdout.splitlines())) <= 80


def test_timeline_writes_a_png_and_prints_its_path(logs, tmp_path):
    out = tmp_path / "pics" / "t.png"
    out.parent.mkdir()
    res = _run("timeline", *logs, "-o", str(out), "--since", "1", "--until", "6", "--title", "two jobs")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_timeline_of_hostile_names(tmp_path):
    log = _write_node(tmp_path / "n0.jsonl", "n0", 0, 0.0, beta_name="$\\frac{$ \x1b[2J")
    out = tmp_path / "t.png"
    res = _run("timeline", str(log), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_timeline_without_matplotlib_says_how_to_install_it(logs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    res = _run("timeline", *logs, "-o", str(tmp_path / "t.png"))
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1 and "pip install" in res.stderr
    assert not (tmp_path / "t.png").exists()
    assert _run("stats", *logs).exit_code == 0, "stats needs no matplotlib"


def test_the_cli_does_not_import_matplotlib():
    code = "import sys, crossover.client.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


@pytest.mark.parametrize("args, code, message", [
    (["missing.jsonl"], 2, "no such file: missing.jsonl"),
    (["--job", "gamma"], 2, "no job 'gamma' in the log (jobs: alpha, beta)"),
    (["--since", "20"], 2, "empty window: 20.0 s to 10.5 s (the log spans 0 to 10.5 s)"),
    (["--since", "5", "--until", "4"], 2, "empty window"),
    (["--since", "10.4", "--job", "alpha"], 1, "no phases of alpha between 10.4 s and 10.5 s"),
    (["--until", "nan"], 2, None),
])
@pytest.mark.parametrize("command", ["stats", "timeline"])
def test_errors_are_one_line_with_an_exit_code(logs, tmp_path, command, args, code, message):
    files = [] if args[0].endswith(".jsonl") else logs
    res = _run(command, *files, *args, "-o" if command == "timeline" else "--json",
               *([str(tmp_path / "t.png")] if command == "timeline" else []))
    assert res.exit_code == code, res.output
    if message is not None:
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("crossover: ")
        assert message in res.stderr
    assert not (tmp_path / "t.png").exists()


def test_a_file_that_is_no_event_log(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n[1, 2]\n")
    res = _run("stats", str(bad))
    assert res.exit_code == 1
    assert res.stderr == f"crossover: {bad} holds no crossoverd events (is it a crossoverd --event-log file?)\n"
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    res = _run("stats", str(binary))
    assert res.exit_code == 1
    assert res.stderr == f"crossover: {binary} is not a crossoverd event log (it is not text)\n"


def test_a_fresh_log_with_only_its_header_is_called_empty(tmp_path):
    fresh = tmp_path / "fresh.jsonl"
    EventLog(path=fresh, flush_interval_s=60).close()
    assert fresh.read_text().startswith('{"event":"log_format"')
    for command in ("stats", "timeline"):
        res = _run(command, str(fresh), *(["-o", str(tmp_path / "t.png")] if command == "timeline" else []))
        assert res.exit_code == 1, res.output
        assert res.stderr.count("\n") == 1 and "no events yet" in res.stderr and "is it a" not in res.stderr


def test_a_huge_window_is_said_in_few_digits(logs):
    res = _run("stats", *logs, "--since", "1e308")
    assert res.exit_code == 2
    assert res.stderr == "crossover: empty window: 1e+308 s to 10.5 s (the log spans 0 to 10.5 s)\n"


def test_timeline_to_a_file_it_cannot_draw_names_what_it_can(logs, tmp_path):
    res = _run("timeline", *logs, "-o", str(tmp_path / "t.xyz"))
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and ".png" in res.stderr and ".xyz" in res.stderr, res.stderr
    assert "Traceback" not in res.output and not (tmp_path / "t.xyz").exists()


def test_version():
    res = _run("--version")
    assert res.exit_code == 0
    assert re.fullmatch(r"crossover \d+\.\d+\.\d+\S*\n", res.stdout)


def test_version_of_a_checkout_that_is_not_installed(monkeypatch):
    import importlib.metadata

    import crossover

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert _run("--version").stdout == f"crossover {crossover.__version__}\n"


def test_timeline_json_says_what_was_drawn(logs, tmp_path):
    out = tmp_path / "t.png"
    res = _run("timeline", *logs, "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["version"] == 2 and data["kind"] == "timeline" and data["path"] == str(out)
    assert data["window"]["until_s"] > data["window"]["since_s"] and data["devices"]
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_timeline_to_a_name_without_an_extension_prints_the_file_it_wrote(logs, tmp_path):
    res = _run("timeline", *logs, "-o", str(tmp_path / "pic"))
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(tmp_path / "pic.png")
    assert (tmp_path / "pic.png").read_bytes().startswith(PNG_MAGIC)


_ALPHA_0 = RankTag(job=ALPHA, job_name="alpha", rank=0, device=0, node="n0")


def _with_drains(tmp_path: Path, drains: int) -> str:
    log = EventLog(path=tmp_path / "d.jsonl", clock=lambda: 1100.0, wall_clock=lambda: 1_700_000_100.0,
                   flush_interval_s=60)
    for i in range(10):
        log.record(Request(iteration=i, seq=i + 1), t=1000.0 + i, about=_ALPHA_0)
        log.record(Grant(iteration=i, waited_s=0.0), t=1000.0 + i, about=_ALPHA_0)
        log.record(Release(held_s=0.5), t=1000.5 + i, about=_ALPHA_0)
    for k in range(drains):
        log.record(Drain(device=1, caller="uid 0 (root)"), t=1000.2 + 9.0 * k / max(drains, 1))
    log.close()
    return str(tmp_path / "d.jsonl")


def test_timeline_marks_name_the_caller_and_json_lists_only_those_in_the_window(tmp_path):
    log = _with_drains(tmp_path, 2)  # at 0.2 s and 4.7 s
    res = _run("timeline", log, "-o", str(tmp_path / "t.png"), "--json", "--since", "2")
    assert res.exit_code == 0, res.output
    marks = json.loads(res.stdout)["marks"]
    assert [m["what"] for m in marks] == ["drain dev1 by uid 0 (root)"] and marks[0]["t_s"] == pytest.approx(4.7)


def test_timeline_with_more_marks_than_labels_fit_says_to_zoom(tmp_path):
    res = _run("timeline", _with_drains(tmp_path, 20), "-o", str(tmp_path / "t.png"))
    assert res.exit_code == 0, res.output
    assert "zoom with --since/--until" in res.stderr


def test_stats_counts_jobs_worth_only_for_the_time_each_job_was_there(tmp_path):
    log = EventLog(path=tmp_path / "seq.jsonl", clock=lambda: 1100.0, wall_clock=lambda: 1_700_000_100.0,
                   flush_interval_s=60)
    for job, name, start in ((ALPHA, "alpha", 0.0), (BETA, "beta", 10.0)):  # one after the other, alone
        for i in range(10):
            t = 1000.0 + start + i
            tag = RankTag(job=job, job_name=name, rank=0, device=0, node="n0")
            log.record(Request(iteration=i, seq=i + 1), t=t, about=tag)
            log.record(Grant(iteration=i, waited_s=0.0), t=t, about=tag)
            log.record(Release(held_s=0.5), t=t + 0.5, about=tag)
            log.record(CommBegin(iteration=i), t=t + 0.5, about=tag)
            log.record(CommEnd(iteration=i, duration_s=0.5), t=t + 1.0, about=tag)
    log.close()
    res = _run("stats", str(tmp_path / "seq.jsonl"))
    assert res.exit_code == 0, res.output
    worth = float(re.search(r"([0-9.]+) jobs' worth", res.stdout).group(1))
    assert worth == pytest.approx(1.0, abs=0.1), res.stdout  # not 2: they never ran together


def test_stats_reads_the_rotated_files_too(tmp_path):
    path = tmp_path / "rot.jsonl"
    log = EventLog(path=path, clock=lambda: 1100.0, wall_clock=lambda: 1_700_000_100.0, flush_interval_s=60,
                   max_bytes=3000, backups=8)
    for i in range(40):
        t = 1000.0 + i
        log.record(Request(iteration=i, seq=i + 1), t=t, about=_ALPHA_0)
        log.record(Grant(iteration=i, waited_s=0.0), t=t, about=_ALPHA_0)
        log.record(Release(held_s=0.5), t=t + 0.5, about=_ALPHA_0)
        log.flush()
    log.close()
    assert (tmp_path / "rot.jsonl.1").exists()
    res = _run("stats", str(path), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["jobs"][0]["iterations"] == 40
