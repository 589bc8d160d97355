"""Distribution `horovod-crossover`: the package `crossover` and nothing else.

One rule maps folders to imports: a path from the repository root is the import
path. The product lives in `crossover/`: `crossover/daemon/scheduler.py` is the
module `crossover.daemon.scheduler`. The folders the design card keeps at the
top, `client/`, `daemon/`, `plugins/` and `protos/`, are links to
`crossover/client` and the rest, so both paths open the same files; imports
name only the real one.
"""
from setuptools import find_packages, setup

setup(
    name="horovod-crossover",
    version="0.1.0",
    description="Time-share GPUs among co-located Horovod jobs (CrossoverScheduler) "
    "with adaptive aggregation",
    python_requires=">=3.9",
    packages=find_packages(include=["crossover", "crossover.*"]),
    package_data={"crossover": ["py.typed"], "crossover.protos": ["*.proto", "*.pyi"]},
    install_requires=[
        "grpcio>=1.84",
        "grpcio-health-checking>=1.84",
        "prometheus-client>=0.20",
        "protobuf>=7.35.1,<8",
        "nvidia-ml-py",
        "psutil",
        "click>=8.1",
        "rich>=13",
    ],
    # The daemon and the CLI need none of the training stack: a node image installs the package alone,
    # a training image `horovod-crossover[plugin]` (torch, Horovod; numpy for group_async).
    extras_require={"plugin": ["torch", "numpy", "horovod"], "plots": ["matplotlib"]},  # plots: crossover timeline
    entry_points={
        "console_scripts": [
            "crossoverd = crossover.daemon.main:main",
            "crossover = crossover.client.cli:main",
        ]
    },
)
