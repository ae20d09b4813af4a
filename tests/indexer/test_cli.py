"""`ragkv index` on the command line: lazy imports, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ragkv.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_help_does_not_import_torch_or_faiss():
    code = ("import sys, ragkv.cli.main as c; c.build_parser().parse_args(['index', 'x', '--out', 'y']); "
            "print(sorted(m for m in ('torch', 'faiss', 'numpy', 'sentence_transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_corpus_is_a_clear_error(tmp_path, capsys):
    assert main(["index", str(tmp_path / "nope"), "--out", str(tmp_path / "ix"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "does not exist: give a folder of .txt, .md, .jsonl, .pdf, .html or .docx files" in err


def test_bad_shard_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    assert main(["index", str(tmp_path / "c"), "--out", str(tmp_path / "ix"), "--shard", "4/4"]) == 1
    assert "shard 4/4 is invalid" in capsys.readouterr().err
