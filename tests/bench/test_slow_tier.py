"""bench/slow_tier.py runs end to end on a tiny model, and its controller avoids the slow tier
(a throttled disk, and a throttled S3 bucket on a moto server)."""

from __future__ import annotations

import json

import pytest


def test_slow_tier_bench_reports_every_configuration(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.slow_tier import main

    rc = main(["--model", str(tiny_llama_dir), "--duration", "1", "--clients", "1", "--latency-ms", "200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    runs = out["runs"]
    assert set(runs) == {f"{t}/controller_{c}" for t in ("disk", "throttled", "s3_throttled") for c in ("off", "on")}
    assert all(r["1"]["requests"] > 0 and r["1"]["errors"] == 0 for r in runs.values())
    # with the controller off every chunk is read, however slow its tier
    assert set(runs["throttled/controller_off"]["1"]["kv_sources"]) == {"loaded"}
    # on, the tiny model computes a chunk long before a 200 ms read would start: it stops reading
    assert runs["throttled/controller_on"]["1"]["kv_sources"].get("computed_cheaper", 0) > 0
    # the same with the KV in S3 (moto over loopback HTTP): read when told to, avoided when slower
    assert set(runs["s3_throttled/controller_off"]["1"]["kv_sources"]) == {"loaded"}
    assert runs["s3_throttled/controller_on"]["1"]["kv_sources"].get("computed_cheaper", 0) > 0
    assert "ttft_p50 on/off (throttled)" in out["ratios"]["1 clients/reuse"]
