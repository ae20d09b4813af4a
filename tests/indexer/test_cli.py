"""`ragkv index` on the command line: lazy imports, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ragkv.cli.main import main
from tests.indexer.helpers import index_chunks

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


def test_the_default_index_is_one_neighbour_and_a_plain_copy(tmp_path, tiny_llama_dir):
    """`ragkv index` with no options builds what the server's defaults were measured on
    (docs/quality.md, issue 39): each chunk's KV after the last 512 tokens of its most similar
    chunk, and its plain KV, int8, for when it is a prompt's first chunk. The manifest records
    it, every chunk's key names its context (not the plain key), and each chunk has two files."""
    from ragkv.indexer.neighbours import INDEX_DEFAULT
    from ragkv.retriever.chunk_keys import NeighbourContext, NeighbourOptions, chunk_key
    from ragkv.retriever.manifest import read_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(["Paris is the capital of France. The secret number is 4721.",
                              "The quick brown fox jumps over the lazy dog. Alice met Bob.",
                              "ragkv stores the KV cache of every chunk and blends them at query time.",
                              "Alice met Bob in Paris. The fox is quick. 0123456789 is not a secret."]):
        (corpus / f"d{i}.txt").write_text(text)
    out = tmp_path / "ix"
    assert main(["index", str(corpus), "--out", str(out), "--model", str(tiny_llama_dir), "--no-progress",
                 "--skip-model-check", "--device", "cpu"]) == 0
    m = read_manifest(out)
    assert INDEX_DEFAULT == NeighbourOptions(m=1, budget_tokens=512, context=NeighbourContext.KV)
    assert NeighbourOptions.from_dict(m.neighbours) == INDEX_DEFAULT
    chunks = index_chunks(out)
    assert len(chunks) == 4
    plain = {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids) for c in chunks}
    assert not plain & {c.kv_key for c in chunks}  # every key names its neighbour context
    stored = sorted(f.stem for f in (out / "kv").rglob("*.safetensors"))
    assert stored == sorted([c.kv_key.to_str() for c in chunks] + [k.to_str() for k in plain])  # two a chunk
