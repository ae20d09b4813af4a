"""bench/slow_tier.py runs end to end on a tiny model, and its controller avoids the slow tier."""

from __future__ import annotations

import json

import pytest


def test_slow_tier_bench_reports_every_configuration(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.slow_tier import main

    rc = main(["--model", str(tiny_llama_dir), "--duration", "1", "--clients", "1", "--latency-ms", "200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    runs = out["runs"]
    assert set(runs) == {"disk/controller_off", "disk/controller_on", "throttled/controller_off",
                         "throttled/controller_on"}
    assert all(r["1"]["requests"] > 0 and r["1"]["errors"] == 0 for r in runs.values())
    # with the controller off every chunk is read, however slow its tier
    assert set(runs["throttled/controller_off"]["1"]["kv_sources"]) == {"loaded"}
    # on, the tiny model computes a chunk long before a 200 ms read would start: it stops reading
    assert runs["throttled/controller_on"]["1"]["kv_sources"].get("computed_cheaper", 0) > 0
    assert "ttft_p50 on/off (throttled)" in out["ratios"]["1 clients/reuse"]
