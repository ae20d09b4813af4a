"""bench/long_prompt.py runs end to end on a tiny model: three bystanders stream, alone and then
beside a client sending full prefill over many chunks, at two prompt step sizes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest


@pytest.mark.slow  # a bench's smoke run: `make test-slow` (tests/conftest.py)
def test_long_prompt_bench_reports_each_step_size_against_the_first(tiny_llama_dir,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from bench.long_prompt import main

    rc = main(["--model", str(tiny_llama_dir), "--duration", "2", "--step-tokens", "0,64,auto", "--long-top-k", "8",
               "--max-new-tokens", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(out["step_tokens"]) == {"0", "64", "auto"}
    rows = {k: r["step_rows_at_end"] for k, r in out["step_tokens"].items()}
    assert rows["0"] == 0 and rows["64"] == 64 and rows["auto"] >= 2048, rows  # auto: sized from speed, 2048 at least
    for r in out["step_tokens"].values():
        assert r["alone"]["bystanders"]["requests"] > 0 and r["long"]["bystanders"]["itl_p99_s"]
        assert r["long"]["fourth"]["requests"] > 0 and r["long"]["fourth"]["ttft_p50_s"] > 0
        assert set(r["itl over alone"]) == {"p50", "p95", "p99"}
    assert set(out["ratios"]) == {f"{what}, {n} vs 0" for n in ("64", "auto") for what in (
        "bystanders itl_p95 over alone", "bystanders itl_p99 over alone", "long ttft_p50", "long ttft_p95")}


@pytest.mark.parametrize("bad", ["0,x", "-1", "0,automatic"])
def test_a_bad_step_size_is_named(bad: str) -> None:
    from bench.long_prompt import main

    with pytest.raises(SystemExit, match="--step-tokens"):
        main(["--step-tokens", bad])


def test_every_long_prompt_command_in_the_docs_parses() -> None:
    from bench.long_prompt import build_parser

    docs = Path(__file__).resolve().parents[2] / "docs"
    found = [m for doc in docs.glob("*.md") for m in re.findall(r"python -m bench\.long_prompt([^`\n]*)", doc.read_text())]
    assert found, "docs/*.md cite the bench"
    for args in found:
        build_parser().parse_args(shlex.split(args))
