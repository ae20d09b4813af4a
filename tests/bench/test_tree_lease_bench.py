"""The tree-lease bench: its command lines as the docs cite them, and a tiny run of both arms."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_tree_lease_bench_command_in_the_docs_and_gpu_check_parses() -> None:
    from bench.tree_lease_bench import build_parser

    pattern = r"python bench/tree_lease_bench\.py([^`\n]*)"
    found = [m for doc in (ROOT / "docs").glob("*.md") for m in re.findall(pattern, doc.read_text())]
    assert found, "docs/*.md cite the bench"
    gpu = re.findall(pattern, (ROOT / "Makefile").read_text())
    assert any("--device cuda" in args for args in gpu), "make gpu-check runs it on the GPU"
    found += gpu
    for args in found:
        parsed = build_parser().parse_args(shlex.split(args))
        assert all(int(t) > 0 for t in parsed.tokens.split(",")), args


def test_a_tiny_run_times_both_arms_and_the_shared_pool_holds_one_copy(monkeypatch, capsys) -> None:
    from bench.tree_lease_bench import main

    monkeypatch.setattr(sys, "argv", ["tree_lease_bench.py", "--tokens", "64,128", "--repeats", "2"])
    main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["tokens"]) == {"64", "128"}
    for row in report["tokens"].values():
        assert row["copy_ms"] > 0 and row["shared_ms"] > 0 and row["speedup"] > 0
        assert row["shared_held_bytes"] * 2 == row["copy_held_bytes"]
