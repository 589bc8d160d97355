"""The files in deploy/ are valid, agree with each other and with crossoverd's own options.

Kubernetes manifests are checked offline against the Kubernetes API's JSON schemas in their
strict form (an unknown field is an error), as bundled by `kubernetes-validate`, for the oldest
Kubernetes we support and the newest the validator knows. The systemd unit is checked by
`systemd-analyze verify` where it exists, and everywhere by reading its settings and ExecStart.
"""
from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import NoReturn

import click
import pytest
import yaml

from crossover.daemon.main import main as crossoverd

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "crossoverd.service"
DAEMONSET = DEPLOY / "kubernetes" / "crossoverd-daemonset.yaml"
TRAINING_POD = DEPLOY / "kubernetes" / "training-pod-example.yaml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
STRICT = os.environ.get("CROSSOVER_TEST_STRICT") == "1"
# gRPC probes, which the DaemonSet uses, are generally available from 1.27.
OLDEST_KUBERNETES = "1.27"


def _missing(what: str) -> NoReturn:
    """Skip for a missing tool, except under `make test` (CROSSOVER_TEST_STRICT=1), where it is an error."""
    if STRICT:
        pytest.fail(what)
    pytest.skip(what)


def _kubernetes_validate():
    try:
        from kubernetes_validate import utils
    except ImportError:
        _missing("kubernetes-validate is not installed (requirements-dev.txt; `make test` installs it)")
    return utils


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(path: Path, kind: str) -> dict:
    docs = [d for d in _documents(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, found {len(docs)}"
    return docs[0]


# --- crossoverd's command line ----------------------------------------------------------------------------------------


def _crossoverd_options() -> dict[str, click.Option]:
    """Every option of crossoverd (`crossoverd --help`), by each of its spellings."""
    return {opt: p for p in crossoverd.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}


def _unknown_flags(args: list[str]) -> list[str]:
    """The flags in a crossoverd command line that crossoverd does not have."""
    opts = _crossoverd_options()
    return [a.partition("=")[0] for a in args if a.startswith("-") and a.partition("=")[0] not in opts]


def _flags(args: list[str]) -> dict[str, str | None]:
    """`--flag value` and `--flag=value` pairs of a command line (a flag that takes no value maps to None)."""
    opts = _crossoverd_options()
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        assert flag.startswith("-"), f"stray argument {args[i]!r} in {args}"
        option = opts.get(flag)
        takes_value = not option.is_flag if option else i + 1 < len(args) and not args[i + 1].startswith("-")
        if takes_value and not eq:
            assert i + 1 < len(args), f"{flag} needs a value"
            i += 1
            value = args[i]
        out[flag] = value if takes_value or eq else None
        i += 1
    return out


def _host_port(address: str | None) -> tuple[str, int]:
    assert address, "no address given"
    host, _, port = address.rpartition(":")
    return host, int(port)


# --- Kubernetes: the schema -------------------------------------------------------------------------------------------


def _kubernetes_versions(utils) -> list[str]:
    """The validator's schema versions to check against: the oldest we support and its newest."""
    known = utils.all_versions()
    oldest = [v for v in known if utils.major_minor(v) == OLDEST_KUBERNETES]
    assert oldest, f"kubernetes-validate {known[0]}..{known[-1]} has no schemas for Kubernetes {OLDEST_KUBERNETES}"
    return sorted({oldest[0], known[-1]})


def schema_errors(doc: dict, version: str) -> list[str]:
    """Why the Kubernetes API of `version` would refuse `doc` (empty if it would not), in strict mode."""
    utils = _kubernetes_validate()
    try:
        utils.validate(doc, version, strict=True)
    except utils.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "(top level)"
        return [f"{where}: {exc.message}"]
    except utils.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def test_there_are_manifests():
    assert {DAEMONSET, TRAINING_POD} <= set(MANIFESTS)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path):
    utils = _kubernetes_validate()
    docs = _documents(path)
    assert docs, f"{path.name} holds no document"
    problems = [f"{path.name} {doc.get('kind')}/{doc.get('metadata', {}).get('name')} (Kubernetes {v}): {err}"
                for v in _kubernetes_versions(utils) for doc in docs for err in schema_errors(doc, v)]
    assert not problems, "\n".join(problems)


def _pod_spec(daemonset: dict) -> dict:
    return daemonset["spec"]["template"]["spec"]


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


@pytest.mark.parametrize(("change", "expect"), [
    (lambda ds: _rename(_pod_spec(ds), "containers", "contianers"), "containers"),
    (lambda ds: _rename(_pod_spec(ds)["containers"][0], "imagePullPolicy", "imagePulPolicy"), "imagePulPolicy"),
    (lambda ds: _rename(ds["spec"], "updateStrategy", "update_strategy"), "update_strategy"),
    (lambda ds: _pod_spec(ds)["containers"][0]["ports"][0].update(containerPort="9464"), "integer"),
    (lambda ds: ds["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": 9464}), "string"),
], ids=["misspelled-required-field", "misspelled-field", "snake-case-field", "port-as-string", "annotation-as-int"])
def test_the_schema_check_refuses_a_broken_manifest(change, expect):
    utils = _kubernetes_validate()
    broken = copy.deepcopy(_one(DAEMONSET, "DaemonSet"))
    change(broken)
    for version in _kubernetes_versions(utils):
        errors = schema_errors(broken, version)
        assert errors, f"a broken DaemonSet passed the schema check of Kubernetes {version}"
        assert expect in errors[0], errors


# --- Kubernetes: the files agree --------------------------------------------------------------------------------------


def _container(pod_spec: dict, name: str | None = None) -> dict:
    containers = pod_spec["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def _daemon() -> tuple[dict, dict, dict[str, str | None]]:
    """The DaemonSet's pod spec, its crossoverd container and that container's flags."""
    spec = _pod_spec(_one(DAEMONSET, "DaemonSet"))
    container = _container(spec, "crossoverd")
    return spec, container, _flags(container.get("args", []))


def _host_side(pod_spec: dict, container: dict, path: str) -> PurePosixPath:
    """Where `path`, seen inside the container, lies on the node: it must be under a hostPath mount."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    inside = PurePosixPath(path)
    for mount in container.get("volumeMounts", []):
        host = volumes[mount["name"]].get("hostPath")
        mounted = PurePosixPath(mount["mountPath"])
        if host and inside.is_relative_to(mounted):
            return PurePosixPath(host["path"]) / inside.relative_to(mounted)
    raise AssertionError(f"{path} is on no hostPath volume mounted by container {container['name']}")


def test_daemonset_flags_are_crossoverd_options():
    _, container, _ = _daemon()
    assert container["command"][-1] == "crossoverd"
    unknown = _unknown_flags(container.get("args", []))
    assert not unknown, f"crossoverd has no option {unknown} (crossoverd --help)"


def test_probes_ask_the_health_port():
    _, container, flags = _daemon()
    host, port = _host_port(flags.get("--health-address"))
    assert host not in ("127.0.0.1", "localhost", "::1"), "kubelet probes the pod's IP: listen on 0.0.0.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == port, f"{probe} asks port {container[probe]['grpc']['port']}"
    assert port in {p["containerPort"] for p in container["ports"]}


def test_metrics_port_is_the_named_port_and_the_scrape_annotation():
    daemonset = _one(DAEMONSET, "DaemonSet")
    _, container, flags = _daemon()
    host, port = _host_port(flags.get("--metrics-address"))
    assert host not in ("127.0.0.1", "localhost", "::1"), "Prometheus scrapes the pod's IP: listen on 0.0.0.0"
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named.get("metrics") == port, f"--metrics-address port {port}, port `metrics` {named.get('metrics')}"
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_daemon_asks_for_no_gpu():
    spec, _, _ = _daemon()
    for c in spec.get("initContainers", []) + spec["containers"]:
        resources = c.get("resources", {})
        for kind in ("requests", "limits"):
            assert "nvidia.com/gpu" not in resources.get(kind, {}), f"{c['name']} would take a GPU from training"
    env = {e["name"]: e.get("value") for e in _container(spec, "crossoverd").get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"


def test_daemon_runs_unprivileged_and_owns_its_socket_folder():
    spec, container, flags = _daemon()
    pod_ctx, ctx = spec["securityContext"], container["securityContext"]
    uid = pod_ctx["runAsUser"]
    assert pod_ctx["runAsNonRoot"] is True and uid > 0 and ctx.get("runAsUser", uid) == uid
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    # kubelet creates the hostPath folder root's, 0755: the init container hands it to the daemon's
    # user and the socket group, or the daemon cannot create its sockets there.
    folder = str(PurePosixPath(flags["--socket"] or "").parent)
    (init,) = spec["initContainers"]
    assert f"os.chown('{folder}', {uid}, {int(flags['--socket-group'] or '')})" in " ".join(init["command"])
    assert f"os.chmod('{folder}', 0o750)" in " ".join(init["command"])


def test_training_pod_reaches_the_daemon_socket():
    spec, container, flags = _daemon()
    pod = _one(TRAINING_POD, "Pod")["spec"]
    trainer = _container(pod)
    env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
    socket = env.get("CROSSOVER_SOCKET")
    assert socket, "the training container sets no CROSSOVER_SOCKET"
    daemon_side = _host_side(spec, container, flags["--socket"] or "")
    assert _host_side(pod, trainer, socket) == daemon_side, "the pod's CROSSOVER_SOCKET is not the daemon's socket"
    assert int(trainer["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_training_pod_is_in_the_socket_group_and_no_pod_shares_the_nodes_pids():
    spec, _, flags = _daemon()
    pod = _one(TRAINING_POD, "Pod")["spec"]
    gid = int(flags["--socket-group"] or "")
    groups = set(pod.get("securityContext", {}).get("supplementalGroups", []))
    groups.add(pod.get("securityContext", {}).get("fsGroup"))
    assert gid in groups, f"the training pod is not in the socket group {gid}"
    # The daemon takes no rank's word for its pid (tests/adversarial/test_container_pids.py): no hostPID.
    assert not spec.get("hostPID") and not pod.get("hostPID")


# --- systemd ----------------------------------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit's settings by section, each key's values in order; a trailing backslash continues a line."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    logical: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            logical.append(line[:-1].strip())
            continue
        line = " ".join([*logical, line]).strip()
        logical = []
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, eq, value = line.partition("=")
        assert eq and current is not None, f"not a setting: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _exec_start(unit: dict[str, dict[str, list[str]]]) -> list[str]:
    (line,) = unit["Service"]["ExecStart"]
    return shlex.split(line)


def _service(key: str) -> str | None:
    values = parse_unit(UNIT.read_text())["Service"].get(key)
    return values[-1] if values else None


def test_unit_runs_crossoverd_with_its_own_options():
    argv = _exec_start(parse_unit(UNIT.read_text()))
    assert argv[0] == "/usr/local/bin/crossoverd"
    args = [a for a in argv[1:] if not a.startswith("$")]
    unknown = _unknown_flags(args)
    assert not unknown, f"crossoverd has no option {unknown} (crossoverd --help)"
    flags = _flags(args)
    socket_folder, log_folder = (PurePosixPath(flags[f] or "").parent for f in ("--socket", "--event-log"))
    assert socket_folder == PurePosixPath("/run", _service("RuntimeDirectory") or "?"), "socket not in RuntimeDirectory"
    assert log_folder == PurePosixPath("/var/log", _service("LogsDirectory") or "?"), "event log not in LogsDirectory"
    for flag in ("--metrics-address", "--health-address"):
        assert _host_port(flags[flag])[0] == "127.0.0.1", f"{flag}: this unit serves it on this node only"


def test_the_flag_check_finds_an_unknown_flag():
    unit = parse_unit("[Service]\nExecStart=/usr/local/bin/crossoverd \\\n  --socket /x.sock \\\n  --no-such-flag 1\n")
    assert _unknown_flags(_exec_start(unit)[1:]) == ["--no-such-flag"]


def test_unit_settings_that_matter():
    assert _service("Type") == "simple"
    assert _service("User") == _service("Group") == "crossover"
    assert _service("KillSignal") == "SIGTERM", "SIGTERM is what releases waiting ranks"
    assert _service("Restart") == "on-failure"
    assert _service("RuntimeDirectoryMode") == "0750"
    assert _service("NoNewPrivileges") == "yes"
    assert _service("ProtectSystem") == "strict"
    # Each of these would keep NVML from /dev/nvidia* or the daemon from its ranks' /proc entries.
    assert _service("PrivateDevices") in (None, "no")
    assert _service("ProtectClock") in (None, "no"), "ProtectClock implies DeviceAllow=char-rtc: a closed device policy"
    assert _service("DeviceAllow") is None and _service("DevicePolicy") in (None, "auto")
    assert _service("ProtectProc") in (None, "default") and _service("ProcSubset") in (None, "all")


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        _missing("systemd-analyze is not installed (Debian package `systemd`)")
    return str(tool)


def _verify(text: str, tmp_path: Path) -> list[str]:
    """What `systemd-analyze verify` says about this unit text, run on a copy whose ExecStart
    names an executable that exists here.

    verify refuses a unit whose command is missing, and /usr/local/bin/crossoverd exists only on
    a node where Crossover is installed; the command is the only thing changed. Unknown keys
    and unparsable values are mere warnings to verify (exit status 0), so every line that
    names the unit counts as a problem.
    """
    tool = _systemd_analyze()
    beside = Path(sys.executable).parent / "crossoverd"
    stand_in = str(beside) if beside.exists() else shutil.which("true") or "/bin/true"
    copy_path = tmp_path / UNIT.name
    copy_path.write_text(text.replace("ExecStart=/usr/local/bin/crossoverd", f"ExecStart={stand_in}"))
    result = subprocess.run([tool, "verify", str(copy_path)], capture_output=True, text=True, timeout=120)
    said = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    if result.returncode != 0 and not said:
        said = [f"exit status {result.returncode}: {result.stderr.strip()}"]
    return said


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    problems = _verify(UNIT.read_text(), tmp_path)
    assert not problems, "\n".join(problems)


def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path):
    text = UNIT.read_text()
    assert "\nRestartSec=" in text
    problems = _verify(text.replace("\nRestartSec=", "\nRestartSecs="), tmp_path)
    assert any("RestartSecs" in p for p in problems), problems
