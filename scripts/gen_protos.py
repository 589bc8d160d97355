"""Regenerate the checked-in gRPC stubs from crossover/protos/*.proto.

Usage: python scripts/gen_protos.py [OUTPUT_DIR]   (default: crossover/protos/)

grpc_tools emits `import crossover_v1_pb2`, a top-level import that would only
work with crossover/protos/ on sys.path; we rewrite it to a package-relative import so
the stubs live inside `crossover.protos`.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "crossover" / "protos"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for proto in sorted(PROTOS.glob("*.proto")):
        with tempfile.TemporaryDirectory() as tmp:
            rc = protoc.main([
                "grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto),
            ])
            if rc != 0:
                raise SystemExit(f"protoc failed on {proto.name} (exit {rc})")
            for gen in sorted(Path(tmp).iterdir()):
                text = gen.read_text()
                text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
                target = out_dir / gen.name
                target.write_text(text)
                written.append(target)
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTOS
    for path in generate(out):
        print(path.relative_to(out.parent) if out == PROTOS else path)
