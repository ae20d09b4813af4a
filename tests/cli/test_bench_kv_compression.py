"""`ragkv bench --kv-compression` and `ragkv eval --kv-compression int4,int2` on a tiny model."""

from __future__ import annotations

import argparse
import json

from ragkv.cli.kv_compression_eval import run_compression_eval
from ragkv.cli.main import main


def test_bench_reads_int4_files_whole_and_layered(tiny_llama_dir, capsys):
    rc = main(["bench", "--model", str(tiny_llama_dir), "--chunks", "2", "--chunk-tokens", "64", "--repeats", "1",
               "--tier", "disk", "--modes", "blend", "--load", "whole,layered", "--kv-compression", "int4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["ttft_median_s"]) == {"blend-whole", "blend-layered"}
    cfg = out["config"]
    assert cfg["kv_compression"] == "int4" and 0 < cfg["kv_file_bytes"] < cfg["kv_bytes"] / 3  # float32 KV


def test_eval_measures_int4_and_int2_against_uncompressed_and_full(tiny_llama_dir):
    args = argparse.Namespace(kv_compression="int4,int2", modes="full,reuse,blend", model=str(tiny_llama_dir),
                              synthetic="niah", n=2, context=128, chunk_tokens=64, ratio="0.15", selector="query",
                              max_new_tokens=4, seed=0)
    report = run_compression_eval(args)
    files, quality = report["files"], report["quality"]
    assert files["int2"]["bytes_per_token"] < files["int4"]["bytes_per_token"] < files["none"]["bytes_per_token"] / 3
    for name in ("int4/reuse", "int4/blend", "int2/reuse", "int2/blend"):
        q = quality[name]
        assert q["n"] == 2 and q["kl_mean"] >= 0 and 0 <= q["f1_vs_full"] <= 1 and 0 <= q["f1_vs_full_uncompressed"] <= 1


def test_eval_reads_a_qa_dataset(tiny_llama_dir, tmp_path):
    rows = [{"question": f"Who wrote book {i}?", "answers": [f"Author {i}"],
             "ctxs": [{"title": f"Book {i}", "text": f"Book {i} was written by Author {i}. " * 6},
                      {"title": "Other", "text": "Nothing about books here. " * 6}]} for i in range(2)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    args = argparse.Namespace(kv_compression="int4", modes="full,reuse", model=str(tiny_llama_dir), dataset=path,
                              n=2, ctxs=2, instruction=None, question_suffix=None, synthetic=None, context=128,
                              chunk_tokens=64, ratio="0.15", selector="query", max_new_tokens=4, seed=0)
    report = run_compression_eval(args)
    assert report["config"]["dataset"] == str(path) and report["quality"]["int4/reuse"]["n"] == 2
