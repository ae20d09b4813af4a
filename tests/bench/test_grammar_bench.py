"""bench/grammar_bench.py runs end to end on a tiny model and reports both runs and ratios."""

from __future__ import annotations

import json

import pytest


def test_grammar_bench_reports_free_and_constrained_in_one_run(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.grammar_bench import main

    rc = main(["--model", str(tiny_llama_dir), "--batch", "1,2", "--tokens", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for b in ("1", "2"):
        runs = out["engine"][b]
        assert runs["free"]["tokens"] > 0 and runs["json_schema"]["tokens"] > 0
        assert runs["free"]["mask_wait_s"] == 0.0  # no constraint, no mask
        assert out["ratios"][f"batch {b}: tokens/s json_schema/free"] > 0
    lib = out["libraries"]["llguidance"]
    assert lib["mask_p50_ms"] > 0 and lib["compile_warm_s"] > 0
