"""The checked-in ragkv/v1 stubs are exactly what the pinned generator produces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    gen_proto = _load_gen_proto()
    generated = gen_proto.generate(tmp_path)
    assert Path("ragkv/v1/ragkv_pb2_grpc.py") in generated
    assert gen_proto.diff(tmp_path, ROOT) == []


def test_drift_is_detected(tmp_path: Path) -> None:
    gen_proto = _load_gen_proto()
    gen_proto.generate(tmp_path)
    stale = tmp_path / "stale"
    (stale / "ragkv" / "v1").mkdir(parents=True)
    for f in (tmp_path / "ragkv" / "v1").iterdir():
        (stale / "ragkv" / "v1" / f.name).write_bytes(f.read_bytes())
    edited = stale / "ragkv" / "v1" / "ragkv_pb2.py"
    edited.write_text(edited.read_text() + "# hand edit\n")
    assert gen_proto.diff(tmp_path, stale) == ["ragkv/v1/ragkv_pb2.py: differs from a fresh generation"]


def test_generated_files_carry_the_banner() -> None:
    for name in ("ragkv_pb2.py", "ragkv_pb2.pyi", "ragkv_pb2_grpc.py"):
        head = (ROOT / "ragkv" / "v1" / name).read_text().splitlines()[:2]
        assert "DO NOT EDIT" in head[1], name


@pytest.mark.parametrize("name", ["ragkv_pb2", "ragkv_pb2_grpc"])
def test_stubs_import(name: str) -> None:
    module = importlib.import_module(f"ragkv.v1.{name}")
    assert module is not None
