"""`ragkv eval` and `ragkv bench` end to end on a tiny model: one JSON object, sane numbers."""

from __future__ import annotations

import json
import os

import pytest

from ragkv.cli.main import main
from ragkv.evals.synthetic import TASKS, make_cases


def _json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"--json must print exactly one line, got {len(out)}"
    return json.loads(out[0])


def test_eval_synthetic_json(tiny_llama_dir, capsys):
    rc = main(["eval", "--synthetic", "niah", "--model", str(tiny_llama_dir), "--n", "2", "--context", "192",
               "--chunk-tokens", "64", "--modes", "full,reuse,blend", "--ratio", "0.2,1.0",
               "--selector", "deviation,query", "--neighbours", "0", "--max-new-tokens", "4", "--json"])
    assert rc == 0
    out = _json(capsys)
    assert set(out["modes"]) == {"full", "reuse", "blend-deviation-0.2", "blend-deviation-1",
                                 "blend-query-0.2", "blend-query-1"}
    full = out["modes"]["full"]
    assert full["n"] == 2 and full["agreement"] == 1.0 and full["kl_mean"] == 0.0
    for name in ("blend-deviation-1", "blend-query-1"):  # ratio 1.0 is full prefill
        assert out["modes"][name]["agreement"] == 1.0
        assert out["modes"][name]["kl_mean"] < 1e-6
        assert out["modes"][name]["recompute_fraction"] == 1.0
    assert out["modes"]["reuse"]["recompute_fraction"] == 0.0
    assert out["modes"]["reuse"]["kl_mean"] > 1e-6
    assert abs(out["modes"]["blend-query-0.2"]["recompute_fraction"] - 0.2) < 0.02
    assert out["config"]["synthetic"] == "niah"


def test_eval_focus_modes_and_plot(tiny_llama_dir, capsys, tmp_path):
    rc = main(["eval", "--synthetic", "niah", "--model", str(tiny_llama_dir), "--n", "2", "--context", "192",
               "--chunk-tokens", "64", "--modes", "full,reuse,focus", "--focus-keep", "1.0,1e-9",
               "--ratio", "1.0", "--neighbours", "0", "--max-new-tokens", "4", "--json"])
    assert rc == 0
    out = _json(capsys)
    assert set(out["modes"]) == {"full", "reuse", "focus-1", "focus-1e-09"}
    # kept chunks are recomputed at ratio 1.0; a lower threshold keeps at least as many chunks
    low, one = out["modes"]["focus-1e-09"], out["modes"]["focus-1"]
    assert 0.0 <= one["recompute_fraction"] <= low["recompute_fraction"] <= 1.0
    result = tmp_path / "eval.json"
    result.write_text(json.dumps(out))
    png = tmp_path / "plots" / "curve.png"
    assert main(["bench", "--plot", str(result), "--plot-out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text('{"modes": {"full": {}}}')
    assert main(["bench", "--plot", str(bad)]) != 0
    assert "not a `ragkv eval --json` result" in capsys.readouterr().err


def test_eval_cases_out_rows_add_up_to_the_report(tiny_llama_dir, capsys, tmp_path):
    """--cases-out: one line per case with each method's scores and focus's chunk relevance;
    their means are the report's, and the spread variants are named apart."""
    rows_file = tmp_path / "cases.jsonl"
    rc = main(["eval", "--synthetic", "niah", "--model", str(tiny_llama_dir), "--n", "3", "--context", "192",
               "--chunk-tokens", "64", "--modes", "full,focus", "--focus-handover", "on", "--focus-spread", "0,1",
               "--focus-keep", "1e-9", "--neighbours", "0", "--max-new-tokens", "4", "--json",
               "--cases-out", str(rows_file)])
    assert rc == 0
    out = _json(capsys)
    assert set(out["modes"]) == {"full", "focus-s0", "focus-s1"}
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["niah-0", "niah-1", "niah-2"]
    for name, report in out["modes"].items():
        got = [r["methods"][name] for r in rows]
        assert sum(g["kl"] for g in got) / 3 == pytest.approx(report["kl_mean"])
        assert sum(g["acc"] for g in got) / 3 == pytest.approx(report["accuracy"])
    for r in rows:
        assert r["methods"]["full"]["answer"] == r["full_answer"] and r["methods"]["full"]["chunk_scores"] is None
        spread0, spread1 = r["methods"]["focus-s0"], r["methods"]["focus-s1"]
        n = len(spread0["chunk_scores"])
        assert n == 3 and max(spread0["chunk_scores"]) > 0.99
        # keep ~0: every chunk is kept; spread 0 hands over to blend, spread 1 never does
        assert spread0["used_chunks"] == spread1["used_chunks"] == list(range(n))


def test_eval_rejects_unknown_mode(tiny_llama_dir, capsys):
    rc = main(["eval", "--synthetic", "niah", "--model", str(tiny_llama_dir), "--modes", "full,sideways"])
    assert rc != 0
    assert "sideways" in capsys.readouterr().err


def test_bench_json(tiny_llama_dir, capsys):
    rc = main(["bench", "--model", str(tiny_llama_dir), "--chunks", "2", "--chunk-tokens", "64",
               "--repeats", "2", "--tier", "disk", "--decode-tokens", "3", "--json"])
    assert rc == 0
    out = _json(capsys)
    assert set(out["ttft_median_s"]) == {"full", "reuse", "blend"}
    assert set(out["decode_ms_per_token"]) == {"full", "reuse", "blend"}
    assert all(ms > 0 for ms in out["decode_ms_per_token"].values())
    assert out["speedup"]["full"] == 1.0
    assert out["kv_load_s"] > 0
    assert out["config"]["prompt_tokens"] > 128
    # per-mode phase medians; blend's query selector scores before its layers
    assert {"assemble", "score", "layers"} <= set(out["phases_median_s"]["blend"])
    assert "score" not in out["phases_median_s"]["reuse"]
    assert sum(out["phases_median_s"]["full"].values()) <= out["ttft_median_s"]["full"] * 1.01


@pytest.mark.parametrize("task", TASKS)
def test_synthetic_cases_hold_their_needles(task):
    cases = make_cases(task, 3, 4, 100, lambda s: len(s.split()), seed=1)
    assert len(cases) == 3 and len({c.question for c in cases}) == 3
    for c in cases:
        assert len(c.chunks) == 4
        text = " ".join(c.chunks)
        assert all(a in text for a in c.answers), "the answer must be in the context"
    assert make_cases(task, 3, 4, 100, lambda s: len(s.split()), seed=1) == cases  # deterministic


@pytest.mark.parametrize("task", TASKS)
def test_synthetic_cases_are_the_same_in_every_process(task):
    """Runs of `ragkv eval` compare over the same cases: nothing in their making may follow
    the process's string hashing (multikey's other keys once were a set, and each process
    placed their needles differently)."""
    import subprocess
    import sys

    code = ("import json; from ragkv.evals.synthetic import make_cases; "
            f"print(json.dumps([c.chunks for c in make_cases({task!r}, 3, 4, 100, lambda s: len(s.split()), 1)]))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(outs) == 1


def test_bench_compares_whole_and_layered_loads_in_one_run(tiny_llama_dir, capsys):
    rc = main(["bench", "--model", str(tiny_llama_dir), "--chunks", "2", "--chunk-tokens", "64", "--repeats", "1",
               "--tier", "disk", "--modes", "full,blend", "--load", "whole,layered", "--budget", "chunk", "--json"])
    assert rc == 0
    out = _json(capsys)
    assert set(out["ttft_median_s"]) == {"full", "blend-whole", "blend-layered"}
    assert set(out["kv_load_s_per_load"]) == {"whole", "layered"} and out["kv_load_s"] > 0
    assert out["config"]["budget"] == "chunk"
    assert main(["bench", "--model", str(tiny_llama_dir), "--load", "sideways"]) != 0
    assert "--load takes whole, layered or both" in capsys.readouterr().err


def test_concurrency_bench_prints_ttft_ratios_and_the_tail(tiny_llama_dir, capsys):
    """`ragkv bench --concurrency`: every level's TTFT over the first level's, per mode, from
    the same run, and the phases the slowest first token of each mode waited on."""
    rc = main(["bench", "--model", str(tiny_llama_dir), "--concurrency", "1,2", "--duration", "2",
               "--max-new-tokens", "4", "--json"])
    out = _json(capsys)
    assert rc == 0 and all(level["errors"] == 0 for level in out["concurrency"].values())
    ratios = out["ttft_vs_baseline"]["2"]
    assert ratios and set(ratios) <= {"full", "blend", "focus", "reuse"}
    for mode, r in ratios.items():
        level, base = out["concurrency"]["2"], out["concurrency"]["1"]
        assert r["p50"] == pytest.approx(level["ttft_p50_s"][mode] / base["ttft_p50_s"][mode], abs=0.01)
        assert r["p99"] == pytest.approx(level["ttft_p99_s"][mode] / base["ttft_p99_s"][mode], abs=0.01)
        assert level["ttft_p50_s"][mode] <= level["ttft_p95_s"][mode] <= level["ttft_p99_s"][mode]
    assert out["config"]["kv_tree_bytes"] == 0  # the tails are the scheduler's, not the tree's
    for mode, tail in out["concurrency"]["2"]["slowest_ttft_phases_s"].items():
        assert tail["ttft"] >= out["concurrency"]["2"]["ttft_p50_s"][mode] and "queue" in tail and "retrieve" in tail


def test_agent_loop_bench_runs_the_loop_with_and_without_the_tree(tiny_llama_dir, capsys):
    """`ragkv bench --agent-loop`: the same tool loop against a server with the KV tree and one
    without, step by step; the tree supplies each later call's earlier prompt, and the ratios
    and the total come from the rows of the same run."""
    rc = main(["bench", "--model", str(tiny_llama_dir), "--agent-loop", "--agent-steps", "3",
               "--tool-result-chars", "300", "--max-new-tokens", "4", "--json"])
    out = _json(capsys)["agent_loop"]
    steps = out["steps"]
    assert rc == 0 and [s["step"] for s in steps] == [0, 1, 2]
    assert steps[0]["tree_tokens"] == 0
    for prev, s in zip(steps, steps[1:]):
        assert s["prompt_tokens"] > prev["prompt_tokens"] and s["tree_tokens"] >= prev["prompt_tokens"] - 16
        assert s["tree_over_step0"] == pytest.approx(s["ttft_tree_s"] / steps[0]["ttft_tree_s"], abs=0.01)
    assert out["total_ttft_tree_s"] == pytest.approx(sum(s["ttft_tree_s"] for s in steps), abs=0.01)
    assert out["total_speedup"] == pytest.approx(out["total_ttft_no_tree_s"] / out["total_ttft_tree_s"], abs=0.01)
    follow = out["follow_up"]
    assert follow["tree"]["prompt_tokens"] == follow["no_tree"]["prompt_tokens"] and follow["no_tree"]["tree_tokens"] == 0
