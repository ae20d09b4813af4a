"""The prompt-batch bench: its command lines as the docs cite them, and a small run of both arms."""

from __future__ import annotations

from tests.bench.cited import cited_args


def test_every_prompt_batch_bench_command_in_the_docs_parses() -> None:
    from bench.prompt_batch_bench import build_parser

    for args in cited_args("prompt_batch_bench.py"):
        parsed = build_parser().parse_args(args)
        assert parsed.clients > 0 and parsed.rows > 0, args


def test_a_small_run_reports_both_arms_with_equal_answers(tiny_llama_dir) -> None:
    """Two requests at once on a tiny model: both arms report their times, only the side arm shares
    layer steps, the ratios are theirs, and the answers are equal (the bench exits otherwise)."""
    from bench.prompt_batch_bench import main

    report = main(["--model", str(tiny_llama_dir), "--clients", "2", "--mode", "reuse", "--chunks", "2",
                   "--chunk-tokens", "40", "--repeats", "1", "--max-new-tokens", "3", "--json"])
    row = report["modes"]["reuse"]
    for arm in ("alone", "side"):
        assert 0 < row[arm]["mean_ttft_s"] <= row[arm]["max_ttft_s"]
    assert row["alone"]["shared_layer_steps"] == 0 < row["side"]["shared_layer_steps"]
    assert row["side_over_alone"]["max_ttft_s"] == row["side"]["max_ttft_s"] / row["alone"]["max_ttft_s"]
