"""An index moves: build it, copy it, delete the original, serve the copy from its own KV."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.retriever.manifest import portable_kv_uris, resolve_kv_uris
from ragkv.server.settings import CollectionSpec
from ragkv.types import Mode, Tier
from tests.server.fakes import ServerThread, settings

CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob.",
    "ragkv.txt": "ragkv stores the KV cache of every chunk and blends them at query time.",
}


def build_index(root: Path, model_dir: Path) -> Path:
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", model=str(model_dir),
                             chunking=ChunkingConfig(size=32, overlap=0), progress=False))
    return root / "index"


def serve_tiers(index_dir: Path) -> list[Tier]:
    """The tier of every chunk's KV on the first REUSE query of a fresh server over ``index_dir``."""
    from ragkv.server.assembly import build_pipeline

    n_chunks = json.loads((index_dir / "manifest.json").read_text())["n_chunks"]
    st = ServerThread(settings(indexes=(CollectionSpec("default", index_dir),)), build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as client:
            stream = client.query("What is the secret number?", mode=Mode.REUSE, top_k=n_chunks, max_new_tokens=2)
            list(stream)
            return [c.kv_tier for c in stream.chunks]
    finally:
        st.stop()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return build_index(tmp_path_factory.mktemp("built"), tiny_llama_dir)


def test_manifest_names_kv_relative_to_the_index(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["kv_uris"] == ["disk:kv"]
    assert any((built / "kv").rglob("*.safetensors"))


def test_copy_serves_every_chunk_from_its_own_disk_tier(tmp_path: Path, tiny_llama_dir: Path) -> None:
    original = build_index(tmp_path / "built-here", tiny_llama_dir)
    copy = tmp_path / "elsewhere" / "index"
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    tiers = serve_tiers(copy)
    assert tiers and set(tiers) == {Tier.DISK}, tiers


def test_old_absolute_manifest_migrates_to_the_copy_kv(built: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kv_uris"] = [f"disk:{tmp_path / 'gone' / 'kv'}"]  # as the old format wrote it, since deleted
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="ragkv.retriever.manifest"):
        tiers = serve_tiers(copy)
    assert tiers and set(tiers) == {Tier.DISK}, tiers
    assert any("does not exist; reading the index's own" in r.message for r in caplog.records)


def test_portable_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    shard = out / "shard-00000-of-00002"
    uris = (f"disk:{out / 'kv'}", "disk:/mnt/external/kv", "s3://bucket/kv")
    assert portable_kv_uris(uris, out, out) == ("disk:kv", "disk:/mnt/external/kv", "s3://bucket/kv")
    assert portable_kv_uris(uris[:1], shard, out) == ("disk:../kv",)
    assert resolve_kv_uris(("disk:../kv",), shard) == (f"disk:{(out / 'kv').resolve()}",)
    monkeypatch.chdir(tmp_path)  # a relative path the user gives is relative to where they are
    assert portable_kv_uris(("disk:mykv",), out, out) == (f"disk:{(tmp_path / 'mykv').resolve()}",)
