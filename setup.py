"""Distribution `horovod-crossover`.

The top-level folders are mapped into one import namespace, `crossover`, so
nothing generic (`daemon`, `client`, ...) lands at the top of site-packages.
"""
from setuptools import setup

_PACKAGE_DIRS = {
    "crossover": "client",
    "crossover.daemon": "daemon",
    "crossover.plugins": "plugins",
    "crossover.protos": "protos",
}

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
        ]
    },
)
