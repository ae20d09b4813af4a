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


def test_the_default_index_stores_plain_kv(tmp_path, tiny_llama_dir):
    """`ragkv index` with no options stores plain chunk KV, the defaults kept after measuring
    the neighbour schemes (docs/quality.md, issue 28): the manifest records no neighbours,
    every key is the plain key, one file a chunk."""
    from ragkv.indexer.kv_job import kv_key
    from ragkv.retriever.chunk_db import ChunkDB
    from ragkv.retriever.manifest import read_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(["Paris is the capital of France. The secret number is 4721.",
                              "The quick brown fox jumps over the lazy dog. Alice met Bob.",
                              "ragkv stores the KV cache of every chunk and blends them at query time."]):
        (corpus / f"d{i}.txt").write_text(text)
    out = tmp_path / "ix"
    assert main(["index", str(corpus), "--out", str(out), "--model", str(tiny_llama_dir), "--no-progress",
                 "--skip-model-check", "--device", "cpu"]) == 0
    m = read_manifest(out)
    assert m.neighbours is None
    db = ChunkDB.open(out, readonly=True)
    try:
        chunks = list(db.iter_chunks())
    finally:
        db.close()
    assert len(chunks) == 3
    assert all(c.kv_key == kv_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids) for c in chunks)
    stored = sorted(f.stem for f in (out / "kv").rglob("*.safetensors"))
    assert stored == sorted(c.kv_key.to_str() for c in chunks)
