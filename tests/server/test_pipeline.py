"""The real pipeline (retriever + kvstore + engine) behind a loopback server, tiny model.

One index is built per session (tiny random Llama, the shipped MiniLM embedder);
tests that need a damaged index copy it first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from ragkv.client import RagClient
from ragkv.retry import NO_RETRY
from ragkv.server.settings import CollectionSpec
from ragkv.types import FinishReason, KVSource, Mode, Tier
from tests.indexer.helpers import index_chunks
from tests.server.fakes import ServerThread, settings

QUESTION = "What is the secret number?"
CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob.",
    "ragkv.txt": "ragkv stores the KV cache of every chunk and blends them at query time.",
    "mix.txt": "Alice met Bob in Paris. The fox is quick. 0123456789 is not a secret.",
}


@pytest.fixture(scope="session")
def tiny_index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    root = tmp_path_factory.mktemp("tiny-index")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", model=str(tiny_llama_dir),
                             chunking=ChunkingConfig(size=32, overlap=0), progress=False))
    return root / "index"


def _copy(index: Path, dest: Path) -> Path:
    shutil.copytree(index, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["kv_uris"] = [f"disk:{(dest / 'kv').resolve()}"]  # the copy's own KV, not the original's
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.fixture(scope="module")
def pipeline_server(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory):
    from ragkv.server.assembly import build_pipeline

    other = _copy(tiny_index, tmp_path_factory.mktemp("other") / "index")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model_fp"] = "f" * 64  # as if another model had built it
    (other / "manifest.json").write_text(json.dumps(manifest))
    st = ServerThread(
        settings(indexes=(CollectionSpec("default", tiny_index), CollectionSpec("other", other)), max_queue=32),
        build_pipeline,
    )
    yield st
    st.stop()


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.PREFIX, Mode.REUSE, Mode.BLEND])
def test_every_mode_streams(pipeline_server: ServerThread, mode: Mode) -> None:
    with RagClient(pipeline_server.addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=mode, top_k=3, max_new_tokens=6, recompute_ratio=0.5)
        chunks = stream.chunks
        pieces = list(stream)
        stats = stream.stats
    assert len(chunks) == 3 and all(c.num_tokens > 0 for c in chunks)
    expected_tiers = {Tier.NOT_LOADED} if mode in (Mode.FULL, Mode.PREFIX) else {Tier.DISK, Tier.CPU}
    assert {c.kv_tier for c in chunks} <= expected_tiers
    assert stats is not None and stats.mode is mode and "".join(pieces) == stats.text
    assert 1 <= stats.usage.completion_tokens <= 6
    assert stats.usage.prompt_tokens > sum(c.num_tokens for c in chunks)
    expected_fraction = {Mode.FULL: 1.0, Mode.PREFIX: 1.0, Mode.REUSE: 0.0, Mode.BLEND: 0.5}[mode]
    assert stats.recompute_fraction == pytest.approx(expected_fraction, abs=0.05)
    assert {"retrieve", "queue", "prompt", "decode"} <= set(stats.phase_seconds)
    assert 0 < stats.ttft_seconds <= stats.total_seconds
    assert stats.used_chunk_ids == tuple(c.chunk_id for c in chunks)  # every retrieved chunk is used


def test_a_stop_string_ends_the_answer_before_it(pipeline_server: ServerThread) -> None:
    """Stop strings are applied where the tokens become text (the answer's relay, off the
    scheduler thread): the answer ends before the stop string, the decode stops there, and
    the usage counts the tokens up to the one that completed it, not those decoded after."""
    with RagClient(pipeline_server.addr, timeout=60) as client:
        base = client.query(QUESTION, mode=Mode.REUSE, top_k=2, max_new_tokens=24).result()
        words = base.text.split()
        assert base.finish_reason is FinishReason.LENGTH and len(words) > 4, base.text  # a random model rambles
        stop = words[3][:3]
        cut = base.text.index(stop)
        stopped = client.query(QUESTION, mode=Mode.REUSE, top_k=2, max_new_tokens=24, stop=[stop]).result()
    assert stopped.text == base.text[:cut]
    assert stopped.finish_reason is FinishReason.STOP
    assert 1 <= stopped.usage.completion_tokens < base.usage.completion_tokens


def test_focus_mode_names_the_chunks_it_kept(pipeline_server: ServerThread) -> None:
    with RagClient(pipeline_server.addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=Mode.FOCUS, top_k=3, max_new_tokens=6)
        retrieved = [c.chunk_id for c in stream.chunks]
        tokens = {c.chunk_id: c.num_tokens for c in stream.chunks}
        stats = stream.result()
        reuse = client.query(QUESTION, mode=Mode.REUSE, top_k=3, max_new_tokens=1).result()
    assert stats.mode is Mode.FOCUS and 1 <= len(stats.used_chunk_ids) <= 3
    assert set(stats.used_chunk_ids) <= set(retrieved)
    # kept chunks keep their prompt order; the prompt holds only them
    assert list(stats.used_chunk_ids) == [c for c in retrieved if c in stats.used_chunk_ids]
    assert "prompt.focus" in stats.phase_seconds
    overhead = reuse.usage.prompt_tokens - sum(tokens.values())  # prefix + question
    assert stats.usage.prompt_tokens == overhead + sum(tokens[c] for c in stats.used_chunk_ids)


def test_focus_keep_setting_reaches_the_engine(tiny_index: Path) -> None:
    """focus_keep 1.0 keeps exactly the best chunk; a tiny one keeps every chunk."""
    from ragkv.server.assembly import build_pipeline

    used = {}
    for keep in (1.0, 1e-9):
        st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), focus_keep=keep),
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                used[keep] = client.query(QUESTION, mode=Mode.FOCUS, top_k=3, max_new_tokens=2).result().used_chunk_ids
        finally:
            st.stop()
    assert len(used[1.0]) == 1 and len(used[1e-9]) == 3


def test_full_mode_equals_engine_full_prefill_and_greedy_decode(
    pipeline_server: ServerThread, tiny_index: Path, tiny_llama_dir: Path
) -> None:
    from ragkv.engine import Engine, Prompt, SamplingParams, load_model
    from ragkv.retriever import Retriever

    with RagClient(pipeline_server.addr, timeout=60) as client:
        stream = client.query(QUESTION, mode="full", top_k=2, max_new_tokens=12)
        served = stream.result()
        chunk_ids = [c.chunk_id for c in stream.chunks]

    engine = Engine(load_model(str(tiny_llama_dir), device="cpu", dtype="float32"))
    with Retriever.open(tiny_index) as retriever:
        hits = retriever.search(QUESTION, 2)
        prefix = list(retriever.manifest.prefix_ids)
    assert [h.chunk_id for h in hits] == chunk_ids
    ids = prefix + [t for h in hits for t in h.token_ids] + engine.prompt.question_ids(QUESTION)
    decode = engine.decode(engine.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=12))
    expected = "".join(decode)
    assert served.text == expected
    assert served.usage.prompt_tokens == len(ids)
    assert served.usage.completion_tokens == len(decode.token_ids)
    assert served.finish_reason is decode.finish_reason  # one FinishReason from the engine to the wire


def test_prompt_step_tokens_reaches_the_engine_and_changes_no_answer(
    tiny_index: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prompt-step-tokens 16: a full prefill's layers run in pieces of 16 rows at most (no
    layer call of the query sees more), and the answer is whole layers' answer."""
    from ragkv.engine import Engine, Prompt, SamplingParams, forward, load_model
    from ragkv.retriever import Retriever
    from ragkv.server.assembly import build_pipeline

    st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), prompt_step_tokens=16),
                      build_pipeline)
    rows: list[int] = []
    real = forward.layer_forward
    monkeypatch.setattr(forward, "layer_forward", lambda ad, i, h, *a, **k: (rows.append(h.shape[0]), real(ad, i, h, *a, **k))[1])
    try:
        with RagClient(st.addr, timeout=60) as client:
            served = client.query(QUESTION, mode="full", top_k=2, max_new_tokens=12).result()
    finally:
        st.stop()
    engine = Engine(load_model(str(tiny_llama_dir), device="cpu", dtype="float32"), step_tokens=0)
    with Retriever.open(tiny_index) as retriever:
        hits = retriever.search(QUESTION, 2)
        prefix = list(retriever.manifest.prefix_ids)
    ids = prefix + [t for h in hits for t in h.token_ids] + engine.prompt.question_ids(QUESTION)
    assert len(ids) > 16 and rows and max(rows) <= 16, (len(ids), rows)
    decode = engine.decode(engine.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=12))
    assert served.text == "".join(decode)


def test_prompt_batch_rows_reaches_the_scheduler_and_changes_no_answer(
    tiny_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prompt-batch-rows: four queries at once (the first layer step held 0.5 s, so the others
    come in meanwhile), whose passes then share layer steps (the ragkv_prompt_layer_passes
    histogram counts steps of several passes), answer as one pass per step answers them."""
    import concurrent.futures
    import time

    from ragkv.engine import scheduler
    from ragkv.server.assembly import build_pipeline

    real = scheduler.run_layers
    held: list[bool] = []

    def first_held(works):  # the tiny model's passes are too short to meet otherwise
        if not held:
            held.append(True)
            time.sleep(0.5)
        real(works)

    monkeypatch.setattr(scheduler, "run_layers", first_held)

    questions = [QUESTION, "Where is the archive?", "Who met in Paris?", "What does the fox do?"]
    answers = {}
    for rows in (0, 100_000):
        held.clear()
        st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), prompt_batch_rows=rows),
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(lambda q: client.query(q, mode="reuse", top_k=2, max_new_tokens=8).result().text, q)
                           for q in questions]
                answers[rows] = [f.result() for f in futures]
            reg = st.server.metrics.registry
            steps = reg.get_sample_value("ragkv_prompt_layer_passes_count")
            alone = reg.get_sample_value("ragkv_prompt_layer_passes_bucket", {"le": "1.0"})
        finally:
            st.stop()
        assert steps and steps > 0
        if rows == 0:
            assert alone == steps  # every layer step carried one pass
        else:
            assert alone < steps, (alone, steps)  # some carried several
    assert answers[0] == answers[100_000]


def test_retrieve_and_collections(pipeline_server: ServerThread) -> None:
    with RagClient(pipeline_server.addr, timeout=60) as client:
        result = client.retrieve(QUESTION, top_k=2, snippet_chars=10)
        assert len(result.chunks) == 2 and all(len(c.text) <= 10 for c in result.chunks)
        assert "secret" in client.retrieve(QUESTION, top_k=1).chunks[0].text
        infos = {c.name: c for c in client.list_collections()}
        assert set(infos) == {"default", "other"} and infos["default"].num_chunks >= 4
        stats = client.collection_stats("default")
        assert [t.tier for t in stats.tiers] == [Tier.CPU, Tier.DISK]
        # top_k beyond the index size is clamped, not an error
        assert len(client.retrieve(QUESTION, top_k=32).chunks) == infos["default"].num_chunks


def test_index_built_with_another_model_is_failed_precondition(pipeline_server: ServerThread) -> None:
    with RagClient(pipeline_server.addr, timeout=60, retry=NO_RETRY) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.query(QUESTION, collection="other"))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "fingerprint" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(client.query(QUESTION, collection="missing"))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND


def test_missing_kv_is_computed_and_written_back(tiny_index: Path, tmp_path: Path) -> None:
    from ragkv.server.assembly import build_pipeline

    index = _copy(tiny_index, tmp_path / "index")
    shutil.rmtree(index / "kv")  # every chunk KV gone from every tier
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),)), build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as client:
            first = client.query(QUESTION, mode="blend", top_k=2, max_new_tokens=4)
            assert {c.kv_tier for c in first.chunks} == {Tier.COMPUTED}
            first_text = first.result().text
            assert first.stats.usage.cached_prompt_tokens < first.stats.usage.prompt_tokens
            second = client.query(QUESTION, mode="blend", top_k=2, max_new_tokens=4)
            assert {c.kv_tier for c in second.chunks} == {Tier.CPU}  # written back, promoted
            assert second.result().text == first_text
            st.server.service.backend.flush_writes(60)  # durable tiers are written on a writer thread
        assert list((index / "kv").rglob("*.safetensors"))  # durable tier written back too
    finally:
        st.stop()


def test_kv_written_by_another_format_version_is_recomputed(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index whose KV files (and stored keys) come from an older format still answers."""
    import ragkv.kvstore.keys
    from ragkv.server.assembly import build_pipeline

    index = _copy(tiny_index, tmp_path / "index")
    monkeypatch.setattr(ragkv.kvstore.keys, "FORMAT_VERSION", ragkv.kvstore.keys.FORMAT_VERSION + 100)
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),)), build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as client:
            stream = client.query(QUESTION, mode="blend", top_k=2, max_new_tokens=4)
            assert stream.result().finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert {c.kv_tier for c in stream.chunks} == {Tier.COMPUTED}
    finally:
        st.stop()


def test_concurrent_clients_on_the_real_pipeline(pipeline_server: ServerThread) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        with RagClient(pipeline_server.addr, timeout=60) as client:
            mode = [Mode.BLEND, Mode.REUSE, Mode.FULL][i % 3]
            return client.query(f"{QUESTION} ({i})", mode=mode, top_k=2, max_new_tokens=4).result().text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(12)))
    assert len(answers) == 12


def test_a_layered_read_that_fails_mid_prompt_is_recomputed(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk whose layer 1 fails its checksum after layer 0 was handed out: the answer is
    computed over fresh KV of that chunk, and equals the answer over the stored KV."""
    import dataclasses

    import ragkv.server.pipeline as sp
    from ragkv.errors import KVFormatError
    from ragkv.kvstore import LayerGate
    from ragkv.server.assembly import build_pipeline

    real = sp.ChunkKV.from_stored
    failed = []

    def first_chunk_fails_at_layer_1(entry, device, dtype, ready=None):
        kv = real(entry, device, dtype, ready)
        if failed or ready is None:
            return kv
        ready.wait_all()  # the real read is done; this gate replays it as broken
        gate = LayerGate(entry.k.shape[0])
        gate.publish(1)
        gate.fail(KVFormatError("checksum mismatch in block 1 (test)"))
        failed.append(gate)
        return dataclasses.replace(kv, ready=gate)

    monkeypatch.setattr(sp.ChunkKV, "from_stored", first_chunk_fails_at_layer_1)
    index = _copy(tiny_index, tmp_path / "index")
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),)), build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as client:
            broken = client.query(QUESTION, mode="blend", top_k=3, max_new_tokens=6, recompute_ratio=0.3)
            assert {c.kv_tier for c in broken.chunks} == {Tier.DISK}
            broken_stats = broken.result()
            assert failed, "no layered read reached the engine"
            again = client.query(QUESTION, mode="blend", top_k=3, max_new_tokens=6, recompute_ratio=0.3)
            again_stats = again.result()
    finally:
        st.stop()
    assert broken_stats.text == again_stats.text
    assert broken_stats.usage.cached_prompt_tokens < again_stats.usage.cached_prompt_tokens


def test_layered_and_whole_reads_give_the_same_answer(tiny_index: Path, tmp_path: Path) -> None:
    from ragkv.server.assembly import build_pipeline

    texts = {}
    for layered in (True, False):
        index = _copy(tiny_index, tmp_path / f"index-{layered}")
        st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_layered=layered),
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                stream = client.query(QUESTION, mode="blend", top_k=3, max_new_tokens=8, recompute_ratio=0.3)
                assert {c.kv_tier for c in stream.chunks} == {Tier.DISK}
                texts[layered] = stream.result().text
        finally:
            st.stop()
    assert texts[True] == texts[False]


def _index_of_corpus(tmp_path: Path, model_dir: Path, **config: object) -> Path:
    """An index of CORPUS by the model in `model_dir`, chunks of 32 tokens, built with `config`."""
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(model_dir), progress=False,
                             chunking=ChunkingConfig(size=32, overlap=0), **config))
    return tmp_path / "index"


def _stored_kv(index: Path, key):
    """Copies of the K and V an index's own disk tier holds under `key`; None when it holds none."""
    from ragkv.kvstore import StoreConfig, TieredStore
    from ragkv.retriever.manifest import read_manifest

    m = read_manifest(index)
    store = TieredStore(StoreConfig.from_uris([f"disk:{index / 'kv'}"]), m.model_fp, m.tokenizer_fp)
    try:
        hit = store.read(key)
        return None if hit is None else (hit.entry.k.clone(), hit.entry.v.clone())
    finally:
        store.close()


@pytest.mark.parametrize("context", ["tokens", "kv"])
def test_a_neighbour_index_is_served_from_its_own_kv(tiny_llama_dir: Path, tmp_path: Path, context: str) -> None:
    """Blend and reuse read the neighbour-conditioned KV the index stored (the index's keys),
    except for the prompt's first chunk where the index stores the plain KV too (--neighbour-context
    kv, the default): it follows the prefix alone, so its plain KV serves it. Focus without handover
    reads the plain KV of every chunk there; focus with handover (the default) reads the neighbour KV
    of the later chunks."""
    from ragkv.retriever.chunk_keys import NeighbourOptions, chunk_key
    from ragkv.retriever.manifest import read_manifest
    from ragkv.server.assembly import build_pipeline

    index = _index_of_corpus(tmp_path, tiny_llama_dir, neighbours=NeighbourOptions(m=1, budget_tokens=256,
                                                                                 context=context))
    m = read_manifest(index)
    chunks = index_chunks(index)
    plain_files = {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids).to_str()
                   for c in chunks}
    stored = {f.stem for f in (index / "kv").rglob("*.safetensors")}
    assert {c.kv_key.to_str() for c in chunks} <= stored  # the neighbour KV of every chunk
    assert bool(plain_files & stored) == (context == "kv")  # and the plain KV only with kv contexts
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1, focus_handover=False),
                      build_pipeline)
    try:
        with RagClient(st.addr, timeout=60) as client:
            for mode in ("blend", "reuse"):
                q = client.query(QUESTION, mode=mode, top_k=2, max_new_tokens=3)
                q.result()
                assert {c.kv_tier for c in q.chunks} == {Tier.DISK}, mode  # the index's neighbour KV
            focus = client.query(QUESTION, mode="focus", top_k=2, max_new_tokens=3)
            focus.result()
            assert {c.kv_tier for c in focus.chunks} == {Tier.DISK}
    finally:
        st.stop()
    if context == "kv":  # focus read plain KV: without it, focus computes while blend still reads
        for f in (index / "kv").rglob("*.safetensors"):
            if f.stem in plain_files and f.stem not in {c.kv_key.to_str() for c in chunks}:
                f.unlink()
        st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1, focus_handover=False),
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                blend = client.query(QUESTION, mode="blend", top_k=2, max_new_tokens=3)
                blend.result()  # the first chunk's plain KV is gone: computed; the second's neighbour KV read
                assert [c.kv_tier for c in blend.chunks] == [Tier.COMPUTED, Tier.DISK]
                focus = client.query(QUESTION, mode="focus", top_k=2, max_new_tokens=3)
                focus.result()
                assert Tier.COMPUTED in {c.kv_tier for c in focus.chunks}
        finally:
            st.stop()
        # focus with handover drops no chunk it blends and blends a lone one: it reads the
        # neighbour KV of every chunk but the first, so an index without the plain copies serves
        # those from disk
        for f in (index / "kv").rglob("*.safetensors"):
            if f.stem in plain_files and f.stem not in {c.kv_key.to_str() for c in chunks}:
                f.unlink()  # the write-backs of the run above
        st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1),  # handover: default
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                focus = client.query(QUESTION, mode="focus", top_k=2, max_new_tokens=3)
                stats = focus.result()
                assert [c.kv_tier for c in focus.chunks] == [Tier.COMPUTED, Tier.DISK]
                assert stats.kv_sources[KVSource.LOADED] == 1
        finally:
            st.stop()


@pytest.mark.parametrize("context", ["tokens", "kv"])
def test_a_lost_neighbour_kv_is_computed_after_its_neighbours_and_kept_under_its_key(
        tiny_llama_dir: Path, tmp_path: Path, context: str) -> None:
    """A chunk whose neighbour-conditioned KV is gone (deleted, damaged, evicted) is computed after
    the neighbours the index records for it, as the indexer computed it (their tokens, or their
    plain KV: read, or computed when that is gone too): the answer is the one the stored KV gives,
    and the KV is written back under the chunk's own key, equal to what was lost. Before, the
    server computed the chunk's plain KV, which changed the answer and could not be kept (so every
    later request computed it again)."""
    import torch

    from ragkv.retriever.chunk_keys import NeighbourOptions, chunk_key
    from ragkv.retriever.manifest import read_manifest
    from ragkv.server.assembly import build_pipeline

    index = _index_of_corpus(tmp_path, tiny_llama_dir, kv_compression="int4", plain_kv_compression="int8",
                             neighbours=NeighbourOptions(m=1, budget_tokens=256, context=context))  # as ragkv index
    m = read_manifest(index)
    assert m.plain_kv_compression == ("int8" if context == "kv" else None)  # the plain copies' own, recorded
    by_key = {c.kv_key.to_str(): c for c in index_chunks(index)}

    def ask() -> tuple[str, list[Tier], list[str]]:
        st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1), build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                q = client.query(QUESTION, mode="blend", top_k=3, max_new_tokens=8, recompute_ratio=0.2)
                text = q.result().text
                return text, [c.kv_tier for c in q.chunks], [c.chunk_id for c in q.chunks]
        finally:
            st.stop()  # (after the writer thread's write-backs)

    def read(key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return _stored_kv(index, by_key[key].kv_key)

    clean, tiers, ids = ask()
    assert tiers == [Tier.DISK] * 3
    lost = next(k for k, c in by_key.items() if c.chunk_id == ids[1])  # the second chunk: its neighbour KV
    was = read(lost)
    assert was is not None
    files = {f.stem: f for f in (index / "kv").rglob("*.safetensors")}
    files[lost].unlink()
    if context == "kv":  # the neighbour's plain KV goes too: the server computes that as well
        plain = {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids).to_str() for c in by_key.values()}
        for stem in set(files) & plain - {lost}:
            files[stem].unlink()
    text, tiers, _ = ask()
    assert tiers[1] is Tier.COMPUTED
    assert text == clean  # the KV the index stored, computed again: the same answer
    back = read(lost)
    assert back is not None, "the computed neighbour KV was not written back under its key"
    torch.testing.assert_close(back[0], was[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(back[1], was[1], rtol=0, atol=1e-6)
    text, tiers, _ = ask()
    assert tiers[1] is Tier.DISK and text == clean  # read again, not computed


@pytest.mark.parametrize("compression", ["int4", "int8"])
def test_a_chunk_computed_answers_as_its_stored_copy_will(tiny_llama_dir: Path, tmp_path: Path,
                                                           compression: str) -> None:
    """A cache that reuses KV changes no answer: over an index whose files are compressed, a chunk
    whose KV is computed (its file lost, or the loading controller finding compute cheaper) is
    served as its stored copy reads back (quantized and dequantized), so the answer is the one
    reading gives; the memory tier keeps it so, and the file written back is the index's own."""
    import torch

    from ragkv.server.assembly import build_pipeline

    index = _index_of_corpus(tmp_path, tiny_llama_dir, kv_compression=compression)
    chunks = {c.chunk_id: c for c in index_chunks(index)}

    def serve(cpu_bytes: int) -> ServerThread:
        return ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=cpu_bytes),
                            build_pipeline)

    def ask(client: RagClient) -> tuple[str, list[Tier], list[str]]:
        q = client.query(QUESTION, mode="blend", top_k=3, max_new_tokens=8, recompute_ratio=0.2)
        return q.result().text, [c.kv_tier for c in q.chunks], [c.chunk_id for c in q.chunks]

    st = serve(1)
    try:
        with RagClient(st.addr, timeout=60) as client:
            clean, tiers, ids = ask(client)
    finally:
        st.stop()
    assert tiers == [Tier.DISK] * 3
    lost = chunks[ids[1]].kv_key
    was = _stored_kv(index, lost)
    next(f for f in (index / "kv").rglob("*.safetensors") if f.stem == lost.to_str()).unlink()
    st = serve(64 << 20)
    try:
        with RagClient(st.addr, timeout=60) as client:
            text, tiers, _ = ask(client)
            assert tiers[1] is Tier.COMPUTED and text == clean
            text, tiers, _ = ask(client)
            assert tiers[1] is Tier.CPU and text == clean  # the memory tier holds it as the file reads
    finally:
        st.stop()
    back = _stored_kv(index, lost)
    assert back is not None and torch.equal(back[0], was[0]) and torch.equal(back[1], was[1])  # the index's own file


def test_computed_kv_is_served_as_the_file_decodes_and_as_computed_where_no_file_can_hold_it() -> None:
    import torch

    from ragkv.engine.kv.cache import ChunkKV
    from ragkv.kvstore import ChunkKey, Compression, KVEntry, hash_prefix
    from ragkv.kvstore.fileformat import decode, encode
    from ragkv.server.pipeline import _stored_as

    assert _stored_as(Compression.NONE) is None  # files keep it bit-exact
    fp, ids = "f" * 64, [7, 8, 9]
    kv = ChunkKV(torch.tensor(ids), torch.randn(2, 1, 3, 64), torch.randn(2, 1, 3, 64), torch.arange(4, 7))
    for c in (Compression.INT8, Compression.INT4):
        served = _stored_as(c)(kv)
        entry = KVEntry.of(kv, ChunkKey.build(fp, fp, [1, 2, 3, 4], ids), fp, fp, hash_prefix([1, 2, 3, 4]))
        stored = decode(encode(entry, c), expected_key=entry.key, model_fp=fp, tokenizer_fp=fp)
        assert torch.equal(served.k, stored.k) and torch.equal(served.v, stored.v), c  # what a read gives
        assert not torch.equal(served.k, kv.k)
    huge = ChunkKV(kv.token_ids, kv.k * 1e6, kv.v, kv.positions)  # past int4's float16 scales
    assert _stored_as(Compression.INT4)(huge) is huge


def test_the_quality_guard_falls_back_to_full_prefill_and_counts_it(tiny_index: Path) -> None:
    """--quality-guard-mass: a blend whose budget cannot hold that share of the question's
    attention runs as full prefill (its answer is full's), and ragkv_quality_fallbacks_total
    counts it beside ragkv_answers_total; a mass the budget holds changes nothing."""
    from ragkv.server.assembly import build_pipeline

    full: list[str] = []

    def ask(mass: float | None) -> tuple[object, float, float]:
        st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), quality_guard_mass=mass),
                          build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                stats = client.query(QUESTION, mode=Mode.BLEND, top_k=3, max_new_tokens=6,
                                     recompute_ratio=0.15).result()
                if not full:
                    full.append(client.query(QUESTION, mode=Mode.FULL, top_k=3, max_new_tokens=6).result().text)
            reg = st.server.metrics.registry
            labels = {"mode": "blend", "collection": "default"}
            return (stats, reg.get_sample_value("ragkv_quality_fallbacks_total", labels) or 0.0,
                    reg.get_sample_value("ragkv_answers_total", labels) or 0.0)
        finally:
            st.stop()

    off, off_fallbacks, off_answers = ask(None)
    short, fallbacks, answers = ask(1.0)  # all of the attention: more than 15% of the tokens hold it
    held, held_fallbacks, _ = ask(1e-6)  # a sliver: the budget always holds it
    assert (off_fallbacks, off_answers) == (0.0, 1.0) and off.recompute_fraction == pytest.approx(0.15, abs=0.05)
    assert (fallbacks, answers) == (1.0, 1.0) and short.recompute_fraction == 1.0
    assert short.text == full[0]  # run as full prefill
    assert held_fallbacks == 0.0 and held.text == off.text


def test_focus_handovers_are_counted_and_answer_over_every_chunk(tiny_index: Path) -> None:
    """ragkv_focus_handovers_total counts the focus answers that blended every chunk: at
    spread 0 (and keep ~0) every focus answer hands over and is computed over all the
    chunks retrieved; at spread 1 none does, and the answer is focus's own, over the best
    chunk (keep 1); a lookup that keeps every chunk (keep ~0) is blend over them all, counted."""
    from ragkv.server.assembly import build_pipeline

    def ask(spread: float, keep: float = 1e-9) -> tuple[object, int, float]:
        st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), focus_keep=keep,
                                   focus_spread=spread), build_pipeline)
        try:
            with RagClient(st.addr, timeout=60) as client:
                stream = client.query(QUESTION, mode=Mode.FOCUS, top_k=3, max_new_tokens=4)
                stats = stream.result()
            reg = st.server.metrics.registry
            return (stats, len(stream.chunks),
                    reg.get_sample_value("ragkv_focus_handovers_total", {"collection": "default"}) or 0.0)
        finally:
            st.stop()

    handed, n, count = ask(0.0)
    assert n == 3 and count == 1.0 and len(handed.used_chunk_ids) == 3
    alone, _, none = ask(1.0, keep=1.0)
    assert none == 0.0 and len(alone.used_chunk_ids) == 1
    every, _, count = ask(1.0)
    assert count == 1.0 and len(every.used_chunk_ids) == 3
