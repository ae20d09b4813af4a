"""Dense, lexical and hybrid search, fusion, metadata filters, the incremental lexical index
and the reranker path, on the small test corpus."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ragkv.indexer.job import run_index
from ragkv.retriever import Retriever
from ragkv.retriever.chunk_db import ChunkDB
from ragkv.retriever.fusion import FusionConfig, FusionMethod, fuse
from ragkv.retriever.lexical import LEXICAL_DIR, LexicalIndex
from ragkv.types import FilterOp, MetadataFilter, SearchMode
from tests.indexer.helpers import JSONL, TOPICS, write_corpus

# Typed metadata: ints, bools and lists must survive the index and filters as JSON types.
TYPED_JSONL = JSONL + [
    {"id": "faq-3", "text": "Refunds for order QZ-8812 are handled by the billing team within a week.",
     "metadata": {"lang": "de", "kind": "faq", "year": 2024, "public": True, "tags": ["billing"]}},
    {"id": "faq-4", "text": "Refunds for order QZ-8813 are handled by the billing team within a month.",
     "metadata": {"lang": "de", "kind": "faq", "year": "2024", "public": False}},
]


@pytest.fixture()
def index_dir(job_config, tiny_lm, embedder):
    write_corpus(job_config.corpus, jsonl=TYPED_JSONL)
    run_index(dataclasses.replace(job_config, precompute_kv=False), lm=tiny_lm, embedder=embedder)
    return job_config.out


@pytest.fixture()
def retriever(index_dir, embedder):
    r = Retriever.open(index_dir, embedder=embedder)
    yield r
    r.close()


def test_each_search_mode_finds_the_code(retriever):
    q = "Who handles refunds for order QZ-8813?"
    for mode in SearchMode:
        hits = retriever.search(q, 3, mode=mode)
        assert hits and hits[0].doc_id == "faq-4", (mode, [h.doc_id for h in hits])
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    lex = retriever.search(q, 3, mode="lexical")
    assert all(h.found_by == (SearchMode.LEXICAL,) for h in lex)
    assert lex[0].score > lex[1].score > 0  # BM25: the exact code outscores its near twin
    dense = retriever.search(q, 3, mode=SearchMode.DENSE)
    assert all(h.found_by == (SearchMode.DENSE,) and -1.0 <= h.score <= 1.0 for h in dense)
    hybrid = retriever.search(q, 3)  # hybrid is the default
    assert retriever.default_mode is SearchMode.HYBRID
    assert set(hybrid[0].found_by) == {SearchMode.DENSE, SearchMode.LEXICAL}
    with pytest.raises(ValueError, match="unknown search mode 'sparse'"):
        retriever.search(q, 3, mode="sparse")


def test_lexical_only_matches_words_dense_misses(retriever):
    # "Phobos" appears once in the corpus; BM25 ranks that chunk first
    hits = retriever.search("Phobos", 1, mode=SearchMode.LEXICAL)
    assert "Phobos" in hits[0].text


def test_rrf_fusion_math_and_weights():
    dense = [(1, 0.9), (2, 0.8), (3, 0.1)]
    lexical = [(3, 12.0), (1, 5.0)]
    fused = fuse(dense, lexical, FusionConfig(rrf_k=60))
    by_row = {f.row: f for f in fused}
    assert by_row[1].score == pytest.approx(1 / 61 + 1 / 62)
    assert by_row[3].score == pytest.approx(1 / 63 + 1 / 61)
    assert by_row[2].score == pytest.approx(1 / 62) and by_row[2].found_by == (SearchMode.DENSE,)
    assert [f.row for f in fused] == [1, 3, 2]
    assert set(by_row[3].found_by) == {SearchMode.DENSE, SearchMode.LEXICAL}
    # all weight on lexical: its order wins; dense-only rows score 0 and trail
    lex_only = fuse(dense, lexical, FusionConfig(dense_weight=0.0, lexical_weight=1.0))
    assert [f.row for f in lex_only][:2] == [3, 1]
    weighted = fuse(dense, lexical, FusionConfig(method=FusionMethod.WEIGHTED, dense_weight=1, lexical_weight=2))
    w = {f.row: f.score for f in weighted}
    assert w[3] == pytest.approx(0.0 + 2 * 1.0) and w[1] == pytest.approx(1.0 + 0.0)
    with pytest.raises(ValueError, match="both 0"):
        FusionConfig(dense_weight=0, lexical_weight=0)
    with pytest.raises(ValueError, match="rrf_k"):
        FusionConfig(rrf_k=-1)


def test_weighted_fusion_in_the_retriever(index_dir, embedder):
    lexical_heavy = FusionConfig(method="weighted", dense_weight=0.0, lexical_weight=1.0)
    with Retriever.open(index_dir, embedder=embedder, fusion=lexical_heavy) as r:
        q = "order QZ-8812 refunds"
        assert [h.chunk_id for h in r.search(q, 2)] == [h.chunk_id for h in r.search(q, 2, mode="lexical")]


def test_filters_apply_before_top_k_in_every_mode(retriever):
    faq = [MetadataFilter("kind", "faq")]
    n_faq = sum(m.get("kind") == "faq" for m in retriever._db.metadata_by_row().values())  # chunks
    assert 4 <= n_faq < len(retriever)
    for mode in SearchMode:
        # the question is about space, yet every hit is a faq: filtered before top-k, not after
        hits = retriever.search("Which planet has two moons?", 3, mode=mode, filters=faq)
        assert len(hits) == 3 and all(h.metadata["kind"] == "faq" for h in hits), mode
        everything = retriever.search("refunds billing password invoices", 10, mode=mode, filters=faq)
        assert {h.doc_id for h in everything} <= {"faq-1", "faq-2", "faq-3", "faq-4"}
        assert len(everything) == min(10, n_faq)  # every mode fills top-k from the allowed rows
        prefix = retriever.search("launch code", 2, mode=mode,
                                  filters=[MetadataFilter("source", "notes/", FilterOp.PREFIX)])
        assert prefix and all(h.doc_id == "notes/needle.txt" for h in prefix)


def test_filters_keep_json_types(retriever):
    q = "refunds billing team"
    as_int = retriever.search(q, 4, mode="lexical", filters=[MetadataFilter("year", 2024)])
    assert {h.doc_id for h in as_int} == {"faq-3"}
    assert as_int[0].metadata["year"] == 2024 and as_int[0].metadata["tags"] == ["billing"]
    as_str = retriever.search(q, 4, mode="dense", filters=[MetadataFilter("year", "2024")])
    assert {h.doc_id for h in as_str} == {"faq-4"}
    assert retriever.search(q, 4, filters=[MetadataFilter("public", True)])[0].doc_id == "faq-3"
    assert [h.doc_id for h in retriever.search(q, 4, filters=[MetadataFilter("public", 1)])] == []
    both = [MetadataFilter("kind", "faq"), MetadataFilter("lang", "de")]
    assert {h.doc_id for h in retriever.search(q, 4, filters=both)} == {"faq-3", "faq-4"}
    assert retriever.search(q, 4, filters=[MetadataFilter("missing", "x")]) == []
    with pytest.raises(ValueError, match="prefix filter on 'year' needs a str"):
        MetadataFilter("year", 20, FilterOp.PREFIX)


def test_lexical_index_follows_incremental_reindex(job_config, tiny_lm, embedder):
    config = dataclasses.replace(job_config, precompute_kv=False)
    run_index(config, lm=tiny_lm, embedder=embedder)
    lex_dir = config.out / LEXICAL_DIR
    assert (lex_dir / "rows.npy").exists()
    with Retriever.open(config.out, embedder=embedder) as r:
        assert r.search("zephyrquartz", 1, mode="lexical")[0].score == 0.0  # no chunk has the word
    # change one document, delete another: the lexical index follows
    (config.corpus / "space.txt").write_text("The zephyrquartz crystal grows only on Titan.", "utf-8")
    (config.corpus / "animals.txt").unlink()
    summary = run_index(config, lm=tiny_lm, embedder=embedder)
    assert summary.documents_added == 1 and summary.documents_deleted == 2
    db = ChunkDB.open(config.out, readonly=True)
    try:
        assert db.lexical_is_current()
        rows, _ = db.texts()
    finally:
        db.close()
    saved = LexicalIndex.load(config.out)
    assert saved is not None and list(saved.rows) == rows
    with Retriever.open(config.out, embedder=embedder) as r:
        hit = r.search("zephyrquartz", 1, mode="lexical")[0]
        assert hit.doc_id == "space.txt" and hit.score > 0
        assert not [h for h in r.search("elephants herds wolves", 5, mode="lexical") if h.doc_id == "animals.txt"]
        assert r.search("zephyrquartz crystal", 1, mode="hybrid")[0].doc_id == "space.txt"
    # an unchanged rerun leaves the lexical files alone
    before = (lex_dir / "rows.npy").stat().st_mtime_ns
    run_index(config, lm=tiny_lm, embedder=embedder)
    assert (lex_dir / "rows.npy").stat().st_mtime_ns == before


def test_index_without_lexical_files_builds_bm25_on_open(index_dir, embedder):
    import shutil

    shutil.rmtree(index_dir / LEXICAL_DIR)  # an index built before BM25 existed
    with Retriever.open(index_dir, embedder=embedder) as r:
        assert r.search("order QZ-8813", 1, mode="lexical")[0].doc_id == "faq-4"


class _PreferWord:
    """A stand-in cross-encoder: scores 1 for texts holding `word`."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.calls: list[int] = []

    def scores(self, question: str, texts):
        self.calls.append(len(texts))
        return np.asarray([float(self.word in t) for t in texts], dtype=np.float32)


def test_reranker_reorders_fused_candidates(index_dir, embedder):
    fake = _PreferWord("Sourdough")
    with Retriever.open(index_dir, embedder=embedder, reranker=fake,
                        fusion=FusionConfig(candidates=20)) as r:
        hits = r.search("What is the launch code?", 2)
        assert "Sourdough" in hits[0].text and hits[0].score == 1.0
        assert fake.calls == [min(20, len(r))]  # the whole fused pool was scored
        plain = r.search("What is the launch code?", 2, rerank=False)
        assert "Sourdough" not in plain[0].text and len(fake.calls) == 1


def test_tiny_cross_encoder_reranks(index_dir, embedder, tmp_path):
    from ragkv.retriever.rerank import Reranker, tiny_cross_encoder_dir

    reranker = Reranker.load(tiny_cross_encoder_dir(tmp_path / "ce"))
    with Retriever.open(index_dir, embedder=embedder, reranker=reranker) as r:
        q = "Who handles refunds for order QZ-8813?"
        hits = r.search(q, 3)
        want = reranker.scores(q, [h.text for h in hits])
        assert [h.score for h in hits] == pytest.approx(want.tolist(), abs=1e-6)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        # the reranked top-3 is the cross-encoder's best three of the fused pool
        pool = r.search(q, len(r), rerank=False)
        best = np.sort(reranker.scores(q, [h.text for h in pool]))[::-1][:3]
        assert [h.score for h in hits] == pytest.approx(best.tolist(), abs=1e-6)
    with pytest.raises(FileNotFoundError, match="no cross-encoder"):
        Reranker.load(tmp_path / "nowhere")


def test_metadata_json_round_trip_in_db(index_dir):
    db = ChunkDB.open(index_dir, readonly=True)
    try:
        meta = {m.get("lang"): m for m in db.metadata_by_row().values() if m.get("kind") == "faq"}
    finally:
        db.close()
    assert meta["de"]["year"] in (2024, "2024")
    assert json.dumps(meta["en"], sort_keys=True) == json.dumps({"kind": "faq", "lang": "en", "source": "faq.jsonl"},
                                                                sort_keys=True)
    assert TOPICS  # the text corpus is indexed beside the JSONL
