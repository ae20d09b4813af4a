"""`ragkv bench --agents`: agents' tool loops at once under four KV-tree policies, in one run,
on a tiny random model."""

from __future__ import annotations

import json

import pytest

from ragkv.cli.main import main


def test_agents_bench_compares_unbounded_lru_retention_and_spill(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--model", str(tiny_llama_dir), "--agents", "3", "--calls", "3", "--tool-latency", "0.05,0.2",
               "--tool-result-chars", "300", "--max-new-tokens", "3", "--top-k", "2", "--tree-share", "0.6", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one line"
    out = json.loads(lines[0])
    agents = out["agents"]
    assert rc == 0 and list(agents["policies"]) == ["unbounded", "lru", "retention", "spill"]
    for name, r in agents["policies"].items():
        assert r["calls"] == 9 and r["errors"] == 0, (name, r["error_samples"])
        assert 0.0 <= r["tree_share"] <= 1.0 and r["prompt_tokens"] > 0
        assert r["tree_share"] == pytest.approx(r["tree_tokens"] / r["prompt_tokens"], abs=1e-3)
        assert 0 < r["ttft_after_tool_p50_s"] <= r["ttft_after_tool_p95_s"] and r["total_s"] > 0
    unbounded, lru, retention, spill = (agents["policies"][p] for p in ("unbounded", "lru", "retention", "spill"))
    # the working set is what the unbounded tree held; the bounded ones get --tree-share of it
    assert unbounded["tree"]["evictions"] == 0 and agents["working_set_bytes"] > 0
    assert agents["budget_bytes"] == int(agents["working_set_bytes"] * 0.6) == lru["tree"]["budget_bytes"]
    assert lru["tree"]["held_bytes"] <= agents["budget_bytes"] and retention["tree"]["held_bytes"] <= agents["budget_bytes"]
    assert unbounded["tree_tokens"] >= lru["tree_tokens"]
    assert lru["tree"]["tool_gaps"] == 0 and retention["tree"]["tool_gaps"] > 0  # only retention learns
    # spill keeps what leaves the device in CPU memory (and on disk): its tree serves what LRU dropped
    assert spill["tree"]["held_bytes"] <= agents["budget_bytes"] and spill["tree"]["spills"] > 0
    assert lru["spilled_share"] == 0 and 0 < spill["spilled_share"] <= spill["tree_share"]
    assert spill["tree_tokens"] > lru["tree_tokens"]
    for name in ("lru", "retention", "spill"):
        ratio = agents["vs_unbounded"][name]
        assert ratio["total_s"] == pytest.approx(agents["policies"][name]["total_s"] / unbounded["total_s"], abs=1e-2)
        assert set(ratio) == {"tree_share", "ttft_after_tool_p50", "ttft_after_tool_p95", "total_s"}
    assert out["config"]["tool_latency_s"] == [0.05, 0.2]


def test_agents_bench_refuses_a_bad_latency_range(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--model", str(tiny_llama_dir), "--agents", "2", "--tool-latency", "3,1"])
    assert rc != 0 and "--tool-latency" in capsys.readouterr().err


def test_agents_bench_refuses_an_unknown_policy(tiny_llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--model", str(tiny_llama_dir), "--agents", "2", "--policies", "spill,fifo"])
    err = capsys.readouterr().err
    assert rc != 0 and "--policies" in err and "fifo" in err
