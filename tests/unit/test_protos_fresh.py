"""The checked-in gRPC stubs are exactly what `scripts/gen_protos.py` makes from the .proto files."""
from __future__ import annotations

from pathlib import Path

from scripts import gen_protos

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "crossover" / "protos"


def test_checked_in_stubs_match_the_proto(tmp_path):
    generated = gen_protos.generate(tmp_path / "out")
    names = sorted(p.name for p in generated)
    assert names, "gen_protos.generate() wrote nothing"
    checked_in = sorted(p.name for p in PROTOS.iterdir() if p.suffix in (".py", ".pyi") and "_pb2" in p.name)
    assert names == checked_in, (
        f"generated {names} but crossover/protos/ holds {checked_in}; run `make protos` and commit the result"
    )
    stale = [n for n in names if (tmp_path / "out" / n).read_bytes() != (PROTOS / n).read_bytes()]
    assert not stale, f"{', '.join(stale)} in crossover/protos/ differ from the .proto sources; run `make protos`"


def test_stubs_use_package_relative_imports():
    grpc_stubs = list(PROTOS.glob("*_pb2_grpc.py"))
    assert grpc_stubs
    for path in grpc_stubs:
        text = path.read_text()
        assert "\nimport crossover_v1_pb2" not in text, f"{path.name} has a top-level import; run `make protos`"
        assert "from . import" in text
