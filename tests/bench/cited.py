"""The bench scripts' command lines as docs/*.md cite them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def cited_args(script: str) -> list[list[str]]:
    """The arguments of every `python bench/SCRIPT ...` line in docs/*.md; fails when none cites it."""
    pattern = rf"python bench/{re.escape(script)}([^`\n]*)"
    found = [shlex.split(m) for doc in DOCS.glob("*.md") for m in re.findall(pattern, doc.read_text())]
    assert found, f"docs/*.md cite bench/{script}"
    return found
