"""One end-to-end test with the shipped SmolLM2-135M: Query(full) equals the engine's
full prefill + greedy decode, and blend answers from stored KV."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from ragkv.types import Mode, Tier
from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import CORPUS

QUESTION = "What is the secret number?"


@pytest.mark.real_model
def test_smollm2_full_equals_engine_and_blend_serves(smollm2, tmp_path: Path) -> None:
    from ragkv.engine import Engine, Prompt, SamplingParams
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index
    from ragkv.retriever import Retriever
    from ragkv.server.assembly import assemble_pipeline

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    index = tmp_path / "index"
    run_index(IndexJobConfig(corpus=corpus, out=index, chunking=ChunkingConfig(size=64, overlap=0),
                             progress=False), lm=smollm2)
    retriever = Retriever.open(index)

    def factory(s):  # share the session's loaded model
        return assemble_pipeline(smollm2, {"default": (index, retriever)}, s)

    st = ServerThread(settings(indexes=(CollectionSpec("default", index),)), factory)
    try:
        with RagClient(st.addr, timeout=120) as client:
            full = client.query(QUESTION, mode="full", top_k=2, max_new_tokens=16)
            full_stats = full.result()
            blend = client.query(QUESTION, mode="blend", top_k=2, max_new_tokens=16, recompute_ratio=0.15)
            blend_stats = blend.result()
        hits = retriever.search(QUESTION, 2)
        engine = Engine(smollm2)
        ids = list(retriever.manifest.prefix_ids) + [t for h in hits for t in h.token_ids] \
            + engine.prompt.question_ids(QUESTION)
        expected = "".join(engine.decode(engine.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=16)))
    finally:
        st.stop()
    assert [c.chunk_id for c in full.chunks] == [h.chunk_id for h in hits]
    assert full_stats.text == expected and expected.strip()
    assert full_stats.mode is Mode.FULL and full_stats.recompute_fraction == 1.0
    assert {c.kv_tier for c in blend.chunks} <= {Tier.DISK, Tier.CPU}
    assert blend_stats.text.strip() and 0.0 < blend_stats.recompute_fraction < 0.5
