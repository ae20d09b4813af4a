"""The pool-agents bench: its command lines as the docs cite them, and a small run of both arms."""

from __future__ import annotations

import json
import sys

from tests.bench.cited import cited_args


def test_every_pool_agents_bench_command_in_the_docs_parses() -> None:
    from bench.pool_agents_bench import build_parser

    for args in cited_args("pool_agents_bench.py"):
        parsed = build_parser().parse_args(args)
        assert parsed.agents > 0 and all(s.isdigit() for s in parsed.seeds.split(",")), args


def test_a_small_run_counts_every_leased_token_lent_or_copied_in_both_arms(monkeypatch, capsys) -> None:
    """Every copied call has its reason, and in a pool too small for every path the arm that keeps
    copied paths in one run, and lends with room for the prompt, copies less."""
    from bench.pool_agents_bench import main

    monkeypatch.setattr(sys, "argv", ["pool_agents_bench.py", "--agents", "6", "--calls", "4", "--seeds", "0",
                                      "--pool-tokens", "4096", "--inflight", "3"])
    main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for arm in ("before", "now"):
        assert 0 < report[arm]["lent_share"] <= 1
        assert sum(report[arm]["copied_because"].values()) == report[arm]["calls_copied"]
    assert report["now"]["copied_tokens"] < report["before"]["copied_tokens"]
    assert report["copied_tokens_now_over_before"] < 1
