"""The batched decode bench's command lines, as the docs cite them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def test_every_batch_decode_bench_command_in_the_docs_parses() -> None:
    from bench.batch_decode_bench import build_parser

    docs = Path(__file__).resolve().parents[2] / "docs"
    found = [m for doc in docs.glob("*.md")
             for m in re.findall(r"python bench/batch_decode_bench\.py([^`\n]*)", doc.read_text())]
    assert found, "docs/*.md cite the bench"
    for args in found:
        parsed = build_parser().parse_args(shlex.split(args))
        assert all(int(b) > 0 for b in parsed.batch.split(",")), args
