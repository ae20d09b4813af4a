"""Every `ragkv ...` command line in README.md and docs/*.md parses with today's parser
(the deploy surfaces have their own test: tests/terraform/test_deploy_commands.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ragkv.cli.main import build_parser
from tests.terraform.test_deploy_commands import ragkv_argvs

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, list[str]]]:
    out = []
    for doc in DOCS:
        blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), re.S)
        for argv in (a for b in blocks for a in ragkv_argvs(b)):
            out.append((f"{doc.relative_to(REPO_ROOT)}: ragkv {shlex.join(argv)[:60]}", argv))
    return out


def test_the_docs_have_commands() -> None:
    found = {argv[0] for _, argv in _commands()}
    assert {"index", "serve", "check-model"} <= found, found


@pytest.mark.parametrize(("where", "argv"), _commands())
def test_doc_command_parses(where: str, argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where} does not parse (see the usage message above)")
