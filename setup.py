"""Distribution `horovod-crossover`.

The top-level folders are mapped into one import namespace, `crossover`, so
nothing generic (`daemon`, `client`, ...) lands at the top of site-packages.
"""
from pathlib import Path

from setuptools import setup

_TOP = {
    "crossover": "client",
    "crossover.daemon": "daemon",
    "crossover.plugins": "plugins",
    "crossover.protos": "protos",
}


def _packages() -> dict[str, str]:
    """Each mapped folder and every sub-folder with an __init__.py, as `crossover.*` packages."""
    found = {}
    for pkg, folder in _TOP.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder)
            found[".".join([pkg, *rel.parts])] = str(init.parent)
    return found


_PACKAGE_DIRS = _packages()

setup(
    name="horovod-crossover",
    version="0.1.0",
    description="Time-share GPUs among co-located Horovod jobs (CrossoverScheduler) "
    "with adaptive aggregation",
    python_requires=">=3.9",
    packages=list(_PACKAGE_DIRS),
    package_dir=_PACKAGE_DIRS,
    package_data={"crossover": ["py.typed"], "crossover.protos": ["*.proto", "*.pyi"]},
    install_requires=[
        "grpcio>=1.84",
        "protobuf>=7.35.1,<8",
        "nvidia-ml-py",
        "psutil",
        "click>=8.1",
        "rich>=13",
        "torch",
        "horovod",
    ],
    entry_points={
        "console_scripts": [
            "crossoverd = crossover.daemon.main:main",
            "crossover = crossover.cli:main",
            "crossover-cluster = crossover.cluster:main",
        ]
    },
)
