"""ragkv eval --kv-compression: compressed KV files measured against uncompressed ones (tiny model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ragkv.cli.kv_compression_eval import parse_compressions, run_compression_eval
from ragkv.kvstore.compression import fp8_supported


def test_parse_compressions() -> None:
    assert parse_compressions("int8, fp8,int8") == ["int8", "fp8"]
    assert parse_compressions("none,int8") == ["int8"]
    with pytest.raises(ValueError, match="'int3'"):
        parse_compressions("int3")


def test_report_on_the_tiny_model(tiny_llama_dir: Path) -> None:
    wanted = "int8,fp8" if fp8_supported() else "int8"
    args = argparse.Namespace(kv_compression=wanted, modes="full,reuse,blend", model=str(tiny_llama_dir),
                              synthetic="niah", n=2, context=128, chunk_tokens=64, seed=0, ratio="0.3",
                              selector="deviation", max_new_tokens=4)
    report = run_compression_eval(args)
    files, quality = report["files"], report["quality"]
    assert files["none"]["bytes_ratio"] == 1.0
    # float32 KV -> 1-byte values plus float32 scales per channel: about a quarter of the bytes
    assert 0.25 < files["int8"]["bytes_ratio"] < 0.4
    assert files["int8"]["bytes_per_token"] < files["none"]["bytes_per_token"] / 2.5
    assert set(quality) == {f"{c}/{m}" for c in wanted.split(",") for m in ("reuse", "blend")}
    for name, q in quality.items():
        assert q["n"] == 2 and 0.0 <= q["kl_mean"] < 0.05, (name, q)
        assert 0.0 <= q["agreement"] <= 1.0 and 0.0 <= q["first_token_agreement"] <= 1.0
    assert report["config"]["modes"] == ["reuse", "blend"]
