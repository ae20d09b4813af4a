"""Retriever: the needle question finds the needle, batches, and clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.indexer.job import run_index
from ragkv.retriever import Retriever, SearchHit
from tests.indexer.helpers import NEEDLE_QUESTION


@pytest.fixture()
def index_dir(job_config, tiny_lm, embedder):
    run_index(dataclasses.replace(job_config, precompute_kv=False), lm=tiny_lm, embedder=embedder)
    return job_config.out


@pytest.fixture()
def retriever(index_dir, embedder):
    r = Retriever.open(index_dir, embedder=embedder)
    yield r
    r.close()


def test_needle_question_finds_the_needle(retriever, tiny_lm):
    from ragkv.engine import Engine

    hits = retriever.search(NEEDLE_QUESTION, top_k=3)
    assert len(hits) == 3 and isinstance(hits[0], SearchHit)
    top = hits[0]
    assert top.doc_id == "notes/needle.txt" and "4721" in top.text
    assert top.metadata == {"source": "notes/needle.txt"}
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert top.token_ids == Engine(tiny_lm).prompt.chunk_ids(top.text)
    from ragkv.retriever.chunk_keys import chunk_key

    m = retriever.manifest
    assert top.kv_key == chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, top.token_ids)


def test_batched_queries_match_single_ones(retriever):
    qs = [NEEDLE_QUESTION, "How long should bread dough be kneaded?", "How do I reset my password?"]
    batch = retriever.search_batch(qs, top_k=2)
    assert [hs[0].doc_id for hs in batch] == ["notes/needle.txt", "cooking.md", "faq-1"]
    assert batch[2][0].metadata["kind"] == "faq"
    for q, hs in zip(qs, batch):
        assert [h.chunk_id for h in retriever.search(q, 2)] == [h.chunk_id for h in hs]


def test_top_k_errors_name_the_value(retriever):
    n = len(retriever)
    assert retriever.search("bread", n)  # the whole index is allowed
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        retriever.search("bread", 0)
    with pytest.raises(ValueError, match=f"top_k={n + 1} is beyond the index size: it holds {n} chunks"):
        retriever.search("bread", n + 1)
    with pytest.raises(ValueError, match="empty"):
        retriever.search("  ", 1)


def test_check_model_and_manifest(retriever, tiny_lm):
    m = retriever.manifest
    assert m.model_fp == tiny_lm.fingerprint and m.chunk_size == 48 and m.prefix_ids
    retriever.check_model(tiny_lm.fingerprint, tiny_lm.tokenizer_fingerprint)
    with pytest.raises(IndexMismatchError, match="fingerprint"):
        retriever.check_model("0" * 64, tiny_lm.tokenizer_fingerprint)
    with pytest.raises(IndexMismatchError, match="tokenizer"):
        retriever.check_model(tiny_lm.fingerprint, "f" * 64)


def test_other_embedder_is_refused(index_dir, embedder):
    class Other:
        spec, fingerprint = "other-model", "ab" * 32

    with pytest.raises(IndexMismatchError, match="built with embedder 'all-MiniLM-L6-v2'"):
        Retriever.open(index_dir, embedder=Other())  # type: ignore[arg-type]


def test_missing_and_incomplete_index(tmp_path, index_dir, embedder):
    with pytest.raises(FileNotFoundError, match="ragkv index CORPUS"):
        Retriever.open(tmp_path / "nothing", embedder=embedder)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    manifest["state"] = "building"
    (index_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RagKVError, match="not complete: rerun"):
        Retriever.open(index_dir, embedder=embedder)


def test_vector_index_kind_by_size():
    import numpy as np

    from ragkv.retriever import vector_index
    from ragkv.retriever.manifest import VectorIndexKind

    assert vector_index.choose_kind(49_999) is VectorIndexKind.FLAT_IP
    assert vector_index.choose_kind(50_000) is VectorIndexKind.HNSW_IP
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((300, 16)).astype(np.float32)
    xb /= np.linalg.norm(xb, axis=1, keepdims=True)
    ids = np.arange(1000, 1300, dtype=np.int64)
    for kind in VectorIndexKind:
        _, found = vector_index.build(ids, xb, kind).search(xb[:5], 1)
        assert list(found[:, 0]) == list(ids[:5])  # ids map back, each vector finds itself
