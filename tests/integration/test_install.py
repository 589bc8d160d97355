"""A regular (non-editable) install holds what the checkout's `crossover/` holds, and nothing else.

The build runs on a copy of the working tree, so it never writes `build/` or
`*.egg-info` into the checkout; pip runs offline (`--no-index`, no build isolation).
"""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SKIP = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                               ".mypy_cache", ".ruff_cache", "results")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    src, site = tmp / "src", tmp / "site"
    shutil.copytree(ROOT, src, ignore=_SKIP, symlinks=True)
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=200, env=env, cwd=tmp,
    )
    assert res.returncode == 0, f"pip install failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return site


pytestmark = pytest.mark.timeout(240)


def _source_view() -> set[str]:
    """Every file the checkout's `crossover/` holds."""
    root = ROOT / "crossover"
    return {str((Path(d) / f).relative_to(root)) for d, _, files in os.walk(root, followlinks=True)
            for f in files if "__pycache__" not in d}


def test_the_install_holds_exactly_what_the_source_view_shows(installed):
    """The one rule: what `crossover/` holds in the checkout is what a node installs."""
    pkg = installed / "crossover"
    got = {str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert got == _source_view()
    for name in ("daemon/scheduler.py", "client/cli/__init__.py", "protos/crossover_v1.proto",
                 "protos/crossover_v1_pb2.pyi", "plugins/hook/horovod_torch.py", "auto.py", "py.typed"):
        assert name in got
    assert not [p for p in installed.rglob("*") if p.is_symlink()], "the install must hold copies, not links"


def test_nothing_generic_at_the_top_of_site_packages(installed):
    generic = {"daemon", "client", "plugins", "protos", "scripts", "tests", "bench", "testbed"}
    top = {p.name.removesuffix(".py") for p in installed.iterdir()}
    assert not generic & top, f"generic top-level names installed: {sorted(generic & top)}"
    dist_infos = list(installed.glob("horovod_crossover-*.dist-info"))
    assert len(dist_infos) == 1
    top_level = dist_infos[0] / "top_level.txt"
    if top_level.exists():
        assert top_level.read_text().split() == ["crossover"]


def test_console_scripts_are_declared(installed):
    (dist_info,) = installed.glob("horovod_crossover-*.dist-info")
    ep = configparser.ConfigParser()
    ep.read(dist_info / "entry_points.txt")
    scripts = dict(ep["console_scripts"])
    assert scripts["crossoverd"] == "crossover.daemon.main:main"
    assert scripts["crossover"] == "crossover.client.cli:main"
    assert set(scripts) == {"crossoverd", "crossover"}, "the test bed's CLI is not part of the product"


_MODULES = ("crossover", "crossover.daemon", "crossover.daemon.policies", "crossover.daemon.scheduler",
            "crossover.daemon.server", "crossover.daemon.main", "crossover.plugins", "crossover.protos",
            "crossover.protos.crossover_v1_pb2_grpc", "crossover.client.rank.session", "crossover.client.cli",
            "crossover.auto")


def _import_files(site: Path, cwd: Path, *python_flags: str) -> list[Path]:
    code = f"import importlib\nfor m in {_MODULES!r}:\n    print(importlib.import_module(m).__file__)\n"
    paths = [str(site)]
    if "-S" in python_flags:  # dependencies (grpc, click, rich) without the checkout's editable-install hook
        paths.append(sysconfig.get_paths()["purelib"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    res = subprocess.run([sys.executable, *python_flags, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env, cwd=cwd)
    assert res.returncode == 0, f"importing the installed copy failed:\n{res.stderr[-3000:]}"
    return [Path(line).resolve() for line in res.stdout.split()]


def test_installed_copy_is_the_one_imported(installed, tmp_path):
    files = _import_files(installed, tmp_path)
    assert files[0].is_relative_to(installed.resolve()), f"crossover came from {files[0]}, not the installed copy"


def test_installed_copy_is_complete_without_the_checkout(installed, tmp_path):
    """`-S` skips the editable install's .pth hook, which would otherwise fill gaps from the checkout."""
    files = _import_files(installed, tmp_path, "-S")
    assert len(files) == len(_MODULES)
    for module, f in zip(_MODULES, files):
        assert f.is_relative_to(installed.resolve()), f"{module} came from {f}, not the installed copy"
