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
    # stored as the quality tables chose (docs/kv-compression.md): each chunk's own KV int4, its plain copy int8
    from ragkv.kvstore.fileformat import read_header

    assert m.kv_compression == "int4"
    files = {f.stem: f for f in (out / "kv").rglob("*.safetensors")}
    assert {read_header(files[c.kv_key.to_str()].read_bytes()).compression.value for c in chunks} == {"int4"}
    assert {read_header(files[k.to_str()].read_bytes()).compression.value for k in plain} == {"int8"}


def test_the_default_index_stores_at_most_one_bf16_copys_bytes():
    """Issue 56: both copies of the default index (each chunk's neighbour KV and its plain copy)
    together hold no more bytes than one plain bf16 copy, for both shipped models' shapes
    (SmolLM2-135M: 30 layers, 3 KV heads of 64; Gemma 3 270M: 18 layers, 1 KV head of 256) at the
    chunk sizes an index makes."""
    from ragkv.indexer.neighbours import INDEX_KV_COMPRESSION, PLAIN_COPY_COMPRESSION
    from ragkv.kvstore.compression import Compression, stored_bytes_per_token

    for shape in [(30, 3, t, 64) for t in (128, 256, 512)] + [(18, 1, t, 256) for t in (128, 256, 512)]:
        both = sum(stored_bytes_per_token(Compression(c), shape) for c in (INDEX_KV_COMPRESSION, PLAIN_COPY_COMPRESSION))
        bf16 = stored_bytes_per_token(Compression.NONE, shape, dtype_bytes=2)
        assert both <= 0.85 * bf16, (shape, both / bf16)


def test_a_rerun_keeps_the_compression_its_index_was_built_with(tmp_path, tiny_llama_dir, capsys):
    """The default changed from none to int4 (issue 56): rerunning `ragkv index` with no
    --kv-compression over an index built uncompressed resumes it as it was built (nothing new to
    compute), where an explicit other format is refused as before."""
    from ragkv.retriever.manifest import read_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Paris is the capital of France. The secret number is 4721.")
    out = tmp_path / "ix"
    base = ["index", str(corpus), "--out", str(out), "--model", str(tiny_llama_dir), "--no-progress",
            "--skip-model-check", "--device", "cpu", "--neighbours", "0"]
    assert main([*base, "--kv-compression", "none"]) == 0
    files = sorted((out / "kv").rglob("*.safetensors"))
    before = [f.read_bytes() for f in files]
    assert main(base) == 0  # the default left out: the index's own none
    assert read_manifest(out).kv_compression == "none"
    assert sorted((out / "kv").rglob("*.safetensors")) == files and [f.read_bytes() for f in files] == before
    capsys.readouterr()
    assert main([*base, "--kv-compression", "int8"]) == 1
    assert "built with another kv_compression" in capsys.readouterr().err
