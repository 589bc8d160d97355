"""The `crossover` CLI through click's runner against an in-process daemon,
and the `crossoverd` entry point's refusals as a real subprocess."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossover.client.cli import ExitCode, main
from crossover.client.rank.session import Session
from crossover.daemon.api import FailedPrecondition
from crossover.daemon.event_log import EventLog
from crossover.daemon.inventory import Device, Inventory
from crossover.daemon.liveness import LivenessSettings
from crossover.daemon.scheduler import Scheduler, SchedulerSettings
from crossover.daemon.server import Daemon, Endpoints
from crossover.protos.event_records import Drain
from crossover.protos.identity import RankIdentity
from crossover.settings import PluginSettings

pytestmark = pytest.mark.timeout(60)

BIN = Path(sys.executable).parent


@pytest.fixture
def daemon(tmp_path):
    settings = SchedulerSettings(policy="exclusive", node="node-cli", heartbeat_interval_s=0.1,
                                 liveness=LivenessSettings(heartbeat_timeout_s=0.8), adapt=False)
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,)), Device(1, "cpu", "cpu1", (1,))]), settings,
                     event_log=EventLog())
    d = Daemon(core, Endpoints(socket_path=str(tmp_path / "cli.sock")), reap_interval_s=0.05).start()
    yield d
    d.stop(grace=0.5)


@pytest.fixture
def run(daemon):
    """`run(*args)` → click Result of `crossover ARGS --socket <daemon's socket>`."""
    runner = CliRunner(env={"COLUMNS": "200", "CROSSOVER_ADDRESS": None, "CROSSOVER_TOKEN": None})

    def invoke(*args: str, socket: str | None = None):
        return runner.invoke(main, [*args, "--socket", socket or daemon.socket_path, "--timeout", "5"])

    return invoke


@pytest.fixture
def session(daemon):
    made: list[Session] = []

    def make(job: str) -> Session:
        settings = PluginSettings(target=f"unix://{daemon.socket_path}", job_name=job, device=0, grant_timeout_s=5.0,
                                  connect_timeout_s=2.0, reconnect_interval_s=30.0, pin=False)
        s = Session(RankIdentity(job_id=f"id-{job}", job_name=job, rank=0, local_rank=0, world_size=1, local_size=1,
                             device=0), settings)
        made.append(s)
        return s.start()

    yield make
    for s in made:
        s.close()


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines!r}"
    return lines[0]


def test_queue_json_is_versioned_and_lists_devices(run):
    res = run("queue", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["version"] == 2 and data["kind"] == "queue"
    assert data["node"] == "node-cli" and data["policy"] == "exclusive"
    assert [d["index"] for d in data["devices"]] == [0, 1]
    assert {d["kind"] for d in data["devices"]} == {"cpu"}
    for dev in data["devices"]:  # defaults are printed so keys are stable; an unset field is null
        assert dev["holders"] == [] and dev["waiting"] == [] and dev["draining"] is False
        assert dev["isolation"] is None and dev["utilization"] is None  # no controller; a CPU's is not measured
    assert res.stderr == ""


def test_queue_json_says_enums_as_the_words_users_type(run, session):
    """A rank's class is `normal` (as `crossover priority` and CROSSOVER_PRIORITY say it), its phase `compute`
    (as the table says it), and no cap is null: the JSON is the client's records, not the protobuf's spelling."""
    assert session("wordjob").acquire(0) is True
    res = run("queue", "--json")
    assert res.exit_code == 0, res.output
    rank = json.loads(res.stdout)["devices"][0]["holders"][0]
    assert rank["job_name"] == "wordjob" and rank["priority"] == "normal" and rank["phase"] == "compute"
    assert rank["handover"] == "cpu" and rank["memory_cap_bytes"] is None
    jobs = json.loads(run("jobs", "--json").stdout)
    assert jobs["version"] == 2 and [j["priority"] for j in jobs["jobs"]] == ["normal"]


def test_queue_json_for_one_device(run):
    res = run("queue", "--json", "--device", "1")
    assert res.exit_code == 0, res.output
    assert [d["index"] for d in json.loads(res.stdout)["devices"]] == [1]
    res = run("queue", "--json", "--device", "5")
    assert res.exit_code == ExitCode.REFUSED
    assert "device 5" in one_line(res.stderr)


def test_queue_table_shows_a_registered_job(run, session):
    s = session("tablejob")
    assert s.acquire(0) is True
    res = run("queue")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "node node-cli" in out and "policy exclusive" in out
    assert "device 0 (cpu cpu0)" in out and "device 1 (cpu cpu1)" in out
    assert "tablejob" in out and "holds" in out and "compute" in out
    assert "idle: no ranks" in out  # device 1


def test_jobs_lists_the_registered_job(run, session):
    session("jobsjob")
    res = run("jobs", "--json")
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.stdout)["jobs"]
    assert [(j["job_name"], j["world_size"], len(j["ranks"])) for j in jobs] == [("jobsjob", 1, 1)]
    res = run("jobs")
    assert res.exit_code == 0 and "jobsjob" in res.stdout


def test_policy_show_and_switch(run, daemon):
    res = run("policy", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["version"] == 2 and data["name"] == "exclusive" and "passthrough" in data["available"]

    res = run("policy", "passthrough")
    assert res.exit_code == 0, res.output
    assert "policy passthrough" in res.stdout
    assert daemon.core.steering.policy_name == "passthrough"
    res = run("policy", "--json")
    assert json.loads(res.stdout)["name"] == "passthrough"
    res = run("policy", "--protect", "0.9")
    assert res.exit_code == 0, res.output
    assert "policy passthrough" in res.stdout and "protect 0.9" in res.stdout and daemon.core.steering.protect == 0.9
    res = run("policy", "--protect", "2")
    assert res.exit_code == 2 and daemon.core.steering.protect == 0.9  # a usage error; nothing changed


def test_unknown_policy_is_refused_with_one_line(run, daemon):
    res = run("policy", "bogus")
    assert res.exit_code == ExitCode.REFUSED == 4
    line = one_line(res.stderr)
    assert line.startswith("crossover: ") and "bogus" in line and "exclusive" in line
    assert res.stdout == ""
    assert daemon.core.steering.policy_name == "exclusive"


def test_drain_unknown_device_is_refused(run):
    res = run("drain", "9")
    assert res.exit_code == ExitCode.REFUSED
    assert "device 9" in one_line(res.stderr)


def test_drain_and_resume(run, daemon):
    res = run("drain", "0", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"version": 2, "kind": "drain", "device": 0, "draining": True}
    assert daemon.core.steering.is_draining(0)
    q = json.loads(run("queue", "--json").stdout)
    assert [d["draining"] for d in q["devices"]] == [True, False]
    assert "DRAINING" in run("queue").stdout

    me = pwd.getpwuid(os.getuid()).pw_name
    drains = [Drain.of(e) for e in daemon.core.events.events() if e.name is Drain.name]
    assert drains and f"user {me} (as the client says)" in drains[-1].caller
    assert drains[-1].caller.startswith("admin socket")
    # a GPU-less test daemon: a CPU rank that lets the daemon choose goes around the drained device,
    # one that insists on it is refused, counted and shown
    with pytest.raises(FailedPrecondition, match="drained by this node's operator"):
        daemon.core.register(RankIdentity(job_id="late", job_name="late", rank=0, local_rank=0, world_size=1,
                                          local_size=1, device=0, pid=os.getpid()))
    assert "DRAINING (1 new rank refused, unscheduled)" in run("queue").stdout

    res = run("resume", "0", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"version": 2, "kind": "resume", "device": 0, "draining": False}
    assert not daemon.core.steering.is_draining(0)
    assert "accepting ranks" in run("resume", "0").stdout


def test_negative_device_is_a_usage_error(run):
    res = run("drain", "-1")
    assert res.exit_code == ExitCode.USAGE


@pytest.mark.parametrize("args", [("drain", "2147483648"), ("queue", "--device", "2147483648"),
                                  ("queue", "--timeout", "nan"), ("policy", "--timeout", "nan")])
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(tmp_path, args):
    res = CliRunner().invoke(main, [*args, "--socket", str(tmp_path / "none.sock")])
    assert res.exit_code == ExitCode.USAGE, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output


def test_unreachable_daemon(run, tmp_path):
    res = run("queue", "--json", socket=str(tmp_path / "nobody.sock"))
    assert res.exit_code == ExitCode.UNREACHABLE == 3
    line = one_line(res.stderr)
    assert "no daemon socket at" in line and "nobody.sock" in line and "CROSSOVER_SOCKET" in line
    assert len(line) - len(str(tmp_path)) < 160 and res.stdout == ""


def test_a_stale_socket_and_a_frozen_daemon_are_told_apart(tmp_path):
    import socket as sockets

    runner = CliRunner(env={"CROSSOVER_ADDRESS": None, "CROSSOVER_TOKEN": None})
    stale = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # the file stays, nobody listens: what a killed daemon leaves
    res = runner.invoke(main, ["queue", "--socket", str(tmp_path / "stale.sock"), "--timeout", "2"])
    assert res.exit_code == ExitCode.UNREACHABLE
    assert "stale socket" in one_line(res.stderr) and "not running" in res.stderr

    frozen = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    frozen.bind(str(tmp_path / "frozen.sock"))
    frozen.listen(8)  # connections are accepted by the kernel, nothing ever answers: a SIGSTOPped daemon
    try:
        res = runner.invoke(main, ["queue", "--socket", str(tmp_path / "frozen.sock"), "--timeout", "1"])
    finally:
        frozen.close()
    assert res.exit_code == ExitCode.UNREACHABLE
    line = one_line(res.stderr)
    assert "accepts connections but did not answer within 1 s" in line and "frozen" in line


@pytest.mark.parametrize("args, words", [
    ((), "Inspect and steer"),
    (("queue",), "holder"),
    (("jobs",), "jobs"),
    (("policy",), "switch"),
    (("drain",), "Stop placing new ranks"),
    (("resume",), "Accept new ranks"),
    (("evict",), "Take DEVICE back"),
    (("priority",), "priority CLASS on this node"),
    (("share",), "share the device by weight"),
    (("stats",), "Per job and per device"),
    (("timeline",), "Draw who computed"),
])
def test_help_of_every_command(args, words):
    res = CliRunner(env={"COLUMNS": "200"}).invoke(main, [*args, "--help"])
    assert res.exit_code == 0, res.output
    assert words in res.stdout
    if args and args[0] not in ("stats", "timeline"):  # those two read event-log files, not a daemon
        assert "--socket" in res.stdout and "--json" in res.stdout


def test_every_command_has_a_help_test():
    assert set(main.commands) == {"queue", "jobs", "policy", "drain", "resume", "evict", "priority", "share", "stats",
                                  "timeline"}


# ---- the crossoverd entry point ---------------------------------------


def _crossoverd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSOVER_")}
    return subprocess.run([str(BIN / "crossoverd"), "--socket", str(tmp_path / "d.sock"), *args],
                          capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)


def test_crossoverd_rejects_bad_cpu_devices(tmp_path):
    res = _crossoverd(tmp_path, "--cpu-devices", "abc")
    assert res.returncode != 0
    line = one_line(res.stderr)
    assert "--cpu-devices" in line and "abc" in line
    assert not (tmp_path / "d.sock").exists()


def test_crossoverd_listen_needs_a_token(tmp_path):
    res = _crossoverd(tmp_path, "--cpu-devices", "1", "--listen", "127.0.0.1:0")
    assert res.returncode != 0
    assert "token" in one_line(res.stderr)


def test_crossoverd_help():
    res = subprocess.run([str(BIN / "crossoverd"), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    assert "Schedule the compute phases" in res.stdout and "--cpu-devices" in res.stdout


def test_the_cli_talks_to_a_tls_daemon_with_tls_ca(tmp_path):
    """`--tls-ca` verifies a daemon served with --tls-cert/--tls-key; without it the call fails, with exit 3."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]),
                     SchedulerSettings(policy="exclusive", node="node-tls", adapt=False), event_log=EventLog())
    endpoints = Endpoints(listen="127.0.0.1:0", token="s3cret", tls=(cert.read_bytes(), key.read_bytes()))
    d = Daemon(core, endpoints, reap_interval_s=0.05).start()
    try:
        runner = CliRunner(env={"CROSSOVER_ADDRESS": None, "CROSSOVER_TOKEN": None, "CROSSOVER_TLS_CA": None})
        base = ["policy", "--address", f"localhost:{d.port}", "--token", "s3cret", "--json", "--timeout", "5"]
        res = runner.invoke(main, [*base, "--tls-ca", str(cert)])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["name"] == "exclusive"
        assert runner.invoke(main, base).exit_code == ExitCode.UNREACHABLE  # plaintext to a TLS port
        res = runner.invoke(main, [*base, "--tls-ca", str(tmp_path / "missing.pem")])
        assert res.exit_code == ExitCode.USAGE and "cannot read --tls-ca" in res.stderr
        settings = PluginSettings.from_env("tls-job")
        rank = Session(RankIdentity("tls-job", "tls-job", 0, 0, 1, 1, device=0),
                       replace(settings, target=f"localhost:{d.port}", token="s3cret", tls_ca=str(cert)))
        try:
            assert rank.start().attached and rank.acquire(0) is True
        finally:
            rank.close()
    finally:
        d.stop(grace=0.5)


def test_queue_watch_streams_snapshots_into_a_pipe(daemon):
    """Piped, --watch prints a snapshot per refresh as it goes (a frame drawn in place would show only at
    the end), and the first column keeps its width from frame to frame."""
    proc = subprocess.Popen([str(BIN / "crossover"), "queue", "--watch", "--interval", "0.2", "--socket",
                             daemon.socket_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(40)]  # type: ignore[union-attr]
    finally:
        proc.terminate()
        proc.wait(10)
    heads = [line for line in lines if line.startswith("node node-cli")]
    assert len(heads) >= 2, "".join(lines)


# ---- issue 56: every answer true, every error one line that says what to do ----------------------------

ADMIN_COMMANDS = [("policy", "exclusive"), ("drain", "0"), ("resume", "0"), ("evict", "0"), ("evict", "--job", "j"),
                  ("priority", "j", "low"), ("share", "j", "2")]


@pytest.fixture
def tcp_daemon():
    """A daemon on TCP alone, with a token and no admin token: it shows, and refuses to be steered."""
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]),
                     SchedulerSettings(policy="exclusive", node="node-tcp", adapt=False), event_log=EventLog())
    d = Daemon(core, Endpoints(socket_path=None, listen="127.0.0.1:0", token="s3cret"), reap_interval_s=0.05).start()
    yield d
    d.stop(grace=0.5)


def test_admin_commands_where_only_the_rank_socket_is_mounted_say_so(run, daemon, tmp_path):
    """A container with crossoverd.sock mounted and not the .admin beside it: the daemon runs, it is its
    admin socket that is not there, and the line says how to reach it."""
    mounted = tmp_path / "container"
    mounted.mkdir()
    (mounted / "crossoverd.sock").symlink_to(daemon.socket_path)
    sock = str(mounted / "crossoverd.sock")
    assert run("queue", socket=sock).exit_code == 0
    for args in ADMIN_COMMANDS:
        res = run(*args, socket=sock)
        assert res.exit_code == ExitCode.FORBIDDEN, (args, res.output)
        line = one_line(res.stderr)
        assert f"crossover {args[0]}" in line and f"{sock}.admin" in line and "not running" not in line, line
        assert "mount" in line, line
    assert daemon.core.steering.policy_name == "exclusive"


def test_an_admin_command_with_no_daemon_names_the_daemon_socket(run, tmp_path):
    res = run("policy", "exclusive", socket=str(tmp_path / "nobody.sock"))
    assert res.exit_code == ExitCode.UNREACHABLE
    line = one_line(res.stderr)
    assert f"no daemon socket at {tmp_path / 'nobody.sock'}:" in line and ".admin" not in line


@pytest.mark.parametrize("args", ADMIN_COMMANDS, ids=lambda a: " ".join(a))
def test_a_refused_admin_command_is_named_as_typed_not_as_its_rpc(tcp_daemon, args):
    res = CliRunner(env={"CROSSOVER_ADDRESS": None, "CROSSOVER_TOKEN": None}).invoke(
        main, [*args, "--address", f"127.0.0.1:{tcp_daemon.port}", "--token", "s3cret", "--timeout", "5"])
    assert res.exit_code == ExitCode.FORBIDDEN, res.output
    warning, line = res.stderr.strip().splitlines()  # the token goes over plain TCP: said first
    assert "plain TCP" in warning
    assert f"crossover {args[0]}" in line and "--admin-token-file" in line, line
    assert not any(rpc in line for rpc in ("SetPolicy", "Drain", "Resume", "Evict", "SetJobClass")), line


def test_a_missing_token_points_to_token_file(tcp_daemon):
    res = CliRunner(env={"CROSSOVER_ADDRESS": None, "CROSSOVER_TOKEN": None}).invoke(
        main, ["queue", "--address", f"127.0.0.1:{tcp_daemon.port}", "--timeout", "5"])
    assert res.exit_code == ExitCode.UNAUTHENTICATED
    assert "--token-file" in one_line(res.stderr)


def test_every_help_names_every_admin_command():
    from crossover.daemon.main import main as crossoverd

    admin = ("policy", "drain", "resume", "evict", "priority", "share")
    top = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["--help"]).stdout
    said = top.split("not allowed", 1)[1]
    assert all(cmd in said for cmd in admin), said
    for param in crossoverd.params:
        if param.name in ("admin_group", "admin_token_file"):
            assert all(cmd in param.help for cmd in admin), param.help  # type: ignore[attr-defined]
    assert all(cmd in crossoverd.help.split("SOCKET.admin")[0] for cmd in admin), crossoverd.help
    cli_doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    codes = cli_doc.split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{cmd}" in codes for cmd in admin), codes


def test_crossoverd_help_lists_what_an_operator_sets_and_help_all_the_tuning_too():
    from crossover.daemon.main import main as crossoverd

    runner = CliRunner(env={"COLUMNS": "200"})
    short = runner.invoke(crossoverd, ["--help"]).stdout
    text = runner.invoke(crossoverd, ["--help-all"]).stdout
    options, tuning = text.split("Tuning (defaults suit most nodes):")
    assert short.split("Tuning:")[0].strip() == options.strip()
    for flag in ("--socket", "--cpu-devices", "--policy", "--class-rule", "--admin-group", "--event-log "):
        assert flag in options, flag
    tuning_flags = ("--heartbeat-timeout", "--evict-after", "--overdue-factor", "--adapt-window", "--protect",
                    "--max-connections")
    for flag in tuning_flags:
        assert flag in tuning and flag not in options and flag not in short, flag
    assert "crossoverd --help-all" in short


def test_evicting_a_job_that_is_not_here_is_refused_and_not_logged(run, daemon):
    res = run("evict", "--job", "nojob")
    assert res.exit_code == ExitCode.REFUSED == run("priority", "nojob", "low").exit_code
    assert "nojob" in one_line(res.stderr) and res.stdout == ""
    assert not [e for e in daemon.core.events.events() if e.name == "evict"]


def test_share_with_a_number_that_is_not_a_weight_is_a_usage_error(run):
    for weight in ("nan", "inf", "-1"):
        res = run("share", "j", weight)
        assert res.exit_code == ExitCode.USAGE, (weight, res.output)
        line = one_line(res.stderr)
        assert "WEIGHT" in line and weight in line and "No such option" not in line, line


def test_a_negative_device_says_what_is_wrong_with_it(run):
    for args in (("drain", "-1"), ("resume", "-1"), ("evict", "-1")):
        res = run(*args)
        assert res.exit_code == ExitCode.USAGE
        line = one_line(res.stderr)
        assert "DEVICE" in line and "-1" in line and "No such option" not in line, line


def test_queue_json_and_table_agree_on_hand_over(run, session):
    session("cpujob")
    rank = json.loads(run("queue", "--json").stdout)["devices"][0]["others"][0]
    assert rank["handover"] == "cpu"


def test_priority_json_is_the_jobs_real_state_and_the_text_names_the_job_as_typed(run, session):
    session("prio")
    res = run("priority", "prio", "low", "--weight", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["kind"] == "job_class" and data["job_id"] == "id-prio" and data["job_name"] == "prio"
    assert data["world_size"] == 1 and len(data["ranks"]) == 1 and data["weight"] == 2.0
    assert data["priority"] == "low" and data["class_set_by"] == "operator"
    assert [(r["priority"], r["weight"]) for r in data["ranks"]] == [("low", 2.0)]
    res = run("share", "prio", "3")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("job prio ") and "low, weight 3" in res.stdout


# ---- the crossoverd entry point, issue 56 ----


def test_crossoverd_names_its_flags_not_its_settings(tmp_path):
    res = _crossoverd(tmp_path, "--cpu-devices", "1", "--heartbeat-timeout", "5", "--evict-after", "1")
    assert res.returncode == 2
    line = one_line(res.stderr)
    assert "--evict-after" in line and "--heartbeat-timeout" in line and "_s" not in line, line


def test_crossoverd_names_an_event_log_it_cannot_open(tmp_path):
    res = _crossoverd(tmp_path, "--cpu-devices", "1", "--event-log", "/proc/version")
    assert res.returncode != 0
    line = one_line(res.stderr)
    assert "--event-log" in line and "/proc/version" in line, line


@pytest.mark.parametrize("spec, cores", [("0", [0]), ("0,", [0]), ("1", [0]), ("0-1", [0, 1]), ("1,0", [1, 0])])
def test_cpu_devices_take_the_lists_the_help_offers(spec, cores):
    from crossover.daemon.inventory import parse_cpu_devices

    assert parse_cpu_devices(spec, 2) == cores


@pytest.mark.parametrize("spec, words", [("2-1", "backwards"), ("99", "this machine has 2"),
                                         ("0-99", "this machine has 2")])
def test_cpu_devices_that_cannot_be_are_one_short_line(spec, words):
    from crossover.daemon.api import InvalidRequest
    from crossover.daemon.inventory import parse_cpu_devices

    with pytest.raises(InvalidRequest) as err:
        parse_cpu_devices(spec, 2)
    assert words in str(err.value) and len(str(err.value)) < 120, str(err.value)


def test_crossoverd_without_a_socket_logs_what_it_serves_on(caplog):
    core = Scheduler(Inventory([Device(0, "cpu", "cpu0", (0,))]),
                     SchedulerSettings(policy="exclusive", node="n", adapt=False), event_log=EventLog())
    with caplog.at_level("INFO", logger="crossover.daemon.server"):
        d = Daemon(core, Endpoints(socket_path=None, listen="127.0.0.1:0", token="t"), reap_interval_s=0.05).start()
        d.stop(grace=0.5)
    line = next(r.getMessage() for r in caplog.records if "serving on" in r.getMessage())
    assert "serving on 127.0.0.1:0" in line and "  " not in line, line


def test_a_relative_socket_path_reaches_the_daemon(run, daemon, monkeypatch):
    """gRPC reads `unix://dir/x.sock` as host `dir`: the client makes the path absolute first."""
    folder, name = os.path.split(daemon.socket_path)
    monkeypatch.chdir(os.path.dirname(folder))
    res = run("queue", "--json", socket=os.path.join(os.path.basename(folder), name))
    assert res.exit_code == 0, res.output
