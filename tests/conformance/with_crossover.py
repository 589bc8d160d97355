"""Run someone else's script with `import crossover.auto` as its first line, without copying it.

    python with_crossover.py SCRIPT [ARGS ...]     # a script, as `python SCRIPT ARGS`
    python with_crossover.py -m MODULE [ARGS ...]  # a module, as `python -m MODULE ARGS`

The conformance tier launches Horovod's own examples and test suite from
`../shared/peer/` this way under `horovodrun`. One thing the machine forces:
torchvision's CPU import needs two op schemas declared (`tools.workloads.vision`).
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import crossover.auto  # noqa: F401  (first, as a user adds it)

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: `tools` is never installed
from tools.workloads.vision import import_torchvision  # noqa: E402


def _import_torchvision() -> None:
    try:
        import_torchvision()
    except ModuleNotFoundError:
        return


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    _import_torchvision()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
