"""Neighbour-conditioned chunk KV: neighbour choice, context budget, keys, and the index job."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
import pytest
import torch

from ragkv.indexer.neighbours import context_ids, select_neighbours
from ragkv.kvstore import FORMAT_VERSION, ChunkContext, ChunkKey, hash_prefix
from ragkv.retriever.chunk_keys import NeighbourChoice, NeighbourOptions
from tests.indexer.helpers import index_chunks

MODEL, TOK = "model-a", "tok-a"


def test_nearest_neighbours_most_similar_first_never_self_nor_duplicates():
    xb = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.6, 0.4], [2.0, 0.0]], dtype=np.float32)
    # row 4 is row 0 scaled: the same passage for cosine similarity, never a neighbour of 0
    got = select_neighbours(xb, NeighbourOptions(m=2))
    assert got[0] == [1, 3]
    assert got[2] == [3, 1]
    assert 4 not in got[0] and 0 not in got[4]
    assert all(i not in nb for i, nb in enumerate(got))
    assert select_neighbours(xb, NeighbourOptions(m=10), rows=[2]) == [[3, 1, 0, 4]]  # m > n - 1: all others
    assert select_neighbours(xb, NeighbourOptions(m=10), rows=[0]) == [[1, 3, 2]]  # 4 duplicates 0
    assert select_neighbours(xb, NeighbourOptions(m=0)) == [[]] * 5


def test_random_neighbours_are_seeded_and_exclude_self():
    xb = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    a = select_neighbours(xb, NeighbourOptions(m=3, choice="random", seed=1))
    assert a == select_neighbours(xb, NeighbourOptions(m=3, choice="random", seed=1))
    assert a != select_neighbours(xb, NeighbourOptions(m=3, choice="random", seed=2))
    assert all(len(nb) == 3 and i not in nb for i, nb in enumerate(a))
    assert a != select_neighbours(xb, NeighbourOptions(m=3))


def test_context_most_similar_next_to_the_chunk_and_cut_to_budget():
    near, far = [1, 2, 3], [7, 8, 9, 10]
    assert context_ids([near, far], 100) == [7, 8, 9, 10, 1, 2, 3]
    assert context_ids([near, far], 5) == [9, 10, 1, 2, 3]  # the far one loses its first tokens
    assert context_ids([near, far], 2) == [2, 3]
    assert context_ids([], 5) == []


def test_options_validate_and_round_trip():
    with pytest.raises(ValueError, match="m >= 0"):
        NeighbourOptions(m=-1)
    with pytest.raises(ValueError):
        NeighbourOptions(m=1, choice="closest")
    o = NeighbourOptions(m=2, budget_tokens=512, choice=NeighbourChoice.RANDOM, seed=3)
    assert NeighbourOptions.from_dict(o.as_dict()) == o
    assert o.tag() == "neighbours:m=2,budget=512,choice=random,seed=3"
    assert NeighbourOptions(m=2).tag() != NeighbourOptions(m=4).tag() != NeighbourOptions(m=2, budget_tokens=9).tag()
    kv = NeighbourOptions(m=2, context="kv")
    assert kv.tag() == "neighbours:m=2,budget=1024,choice=nearest,context=kv"  # tokens keep their old tag
    assert NeighbourOptions.from_dict(kv.as_dict()) == kv
    assert NeighbourOptions.from_dict({"m": 2, "budget_tokens": 1024, "choice": "nearest"}).context.value == "tokens"
    with pytest.raises(ValueError):
        NeighbourOptions(m=1, context="text")


def _old_key(prefix_ids, chunk_ids) -> str:
    """The key derivation of a plain chunk before contexts existed, written out by hand."""
    def ids(xs):
        return struct.pack("<Q", len(xs)) + b"".join(struct.pack("<q", x) for x in xs)

    def s(x):
        return struct.pack("<Q", len(x.encode())) + x.encode()

    h = hashlib.sha256(b"ragkv-chunk\0" + struct.pack("<I", FORMAT_VERSION) + s(MODEL) + s(TOK)
                       + s(hash_prefix(prefix_ids)) + ids(chunk_ids))
    return h.hexdigest()


def test_keys_differ_with_context_and_options_and_plain_keys_keep_their_meaning():
    prefix, chunk = [1, 2], [5, 6, 7]
    plain = ChunkKey.build(MODEL, TOK, prefix, chunk)
    assert plain.hex == _old_key(prefix, chunk)
    m2 = ChunkKey.build(MODEL, TOK, prefix, chunk, ChunkContext(NeighbourOptions(m=2).tag(), (9, 9)))
    m4 = ChunkKey.build(MODEL, TOK, prefix, chunk, ChunkContext(NeighbourOptions(m=4).tag(), (9, 9)))
    other_ctx = ChunkKey.build(MODEL, TOK, prefix, chunk, ChunkContext(NeighbourOptions(m=2).tag(), (9, 8)))
    empty_ctx = ChunkKey.build(MODEL, TOK, prefix, chunk, ChunkContext(NeighbourOptions(m=2).tag(), ()))
    assert len({plain, m2, m4, other_ctx, empty_ctx}) == 5
    assert m2 == ChunkKey.build(MODEL, TOK, prefix, chunk, ChunkContext(NeighbourOptions(m=2).tag(), [9, 9]))
    with pytest.raises(ValueError, match="tag"):
        ChunkContext("", ())


def test_prefill_with_context_is_the_chunk_slice_of_one_pass(tiny_lm):
    from ragkv.engine import Engine

    eng, prefix = Engine(tiny_lm), [1, 5, 9]
    ctx, own = [20, 21, 22, 23], [30, 31, 32]
    whole = eng.prefill(prefix, ctx + own)
    kv = eng.prefill(prefix, own, ctx)
    assert kv.token_ids.tolist() == own and kv.positions.tolist() == [7, 8, 9]
    torch.testing.assert_close(kv.k, whole.k[:, :, 4:])
    torch.testing.assert_close(kv.v, whole.v[:, :, 4:])
    plain = eng.prefill(prefix, own)
    assert not torch.allclose(plain.v[1:], kv.v[1:])  # layer 0's V sees no context; later ones do


def test_serving_neighbour_kv_every_mode_and_blend_1_equals_full(tiny_lm):
    from ragkv.engine import BlendOptions, Engine, Prompt
    from ragkv.types import Mode

    eng = Engine(tiny_lm)
    p = eng.prompt
    prefix_ids = p.prefix_ids()
    prefix = prefix_ids
    texts = ["Paris is the capital of France.", "The secret number is 4721.", "Alice met Bob."]
    ids = [p.chunk_ids(t) for t in texts]
    kvs = [eng.prefill(prefix, c, ids[(i + 1) % 3]) for i, c in enumerate(ids)]
    assert all(int(kv.positions[0]) > len(prefix_ids) for kv in kvs)
    q = p.question_ids("What is the secret number?")
    full = eng.run(Prompt(p.prompt_ids(texts, "What is the secret number?")), Mode.FULL)
    for mode in (Mode.REUSE, Mode.BLEND, Mode.FOCUS, Mode.PREFIX):
        res = eng.run(Prompt(q, prefix_ids, ids, kvs), mode)
        assert torch.isfinite(res.logits).all()
    for sel in ("query", "deviation"):
        res = eng.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=1.0, selector=sel))
        torch.testing.assert_close(res.logits, full.logits, atol=1e-4, rtol=1e-4)
    early = dataclasses.replace(kvs[0], positions=kvs[0].positions - kvs[0].positions[0])  # before the prefix
    with pytest.raises(ValueError, match="prefix of 0 tokens"):
        eng.run(Prompt.of(prefix, [early], q), Mode.REUSE)


def test_index_with_neighbours_records_options_keys_and_stores_context_kv(job_config, tiny_lm, embedder):
    from ragkv.indexer.job import run_index
    from ragkv.indexer.kv_job import open_store
    from ragkv.kvstore import KVEntry  # noqa: F401  (the store's entry type)
    from ragkv.retriever.chunk_keys import chunk_key
    from ragkv.retriever.manifest import read_manifest

    plain_cfg = dataclasses.replace(job_config, out=job_config.out.parent / "plain")
    run_index(plain_cfg, lm=tiny_lm, embedder=embedder)
    opts = NeighbourOptions(m=2, budget_tokens=64)
    cfg = dataclasses.replace(job_config, neighbours=opts)
    s = run_index(cfg, lm=tiny_lm, embedder=embedder)
    m = read_manifest(cfg.out)
    assert m.neighbours == opts.as_dict() and read_manifest(plain_cfg.out).neighbours is None
    chunks = index_chunks(cfg.out)
    plain_keys = {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids) for c in chunks}
    assert not plain_keys & {c.kv_key for c in chunks}  # every chunk was computed with context
    assert s.kv_chunks == len(chunks)
    store = open_store([f"disk:{cfg.out / 'kv'}"], m.model_fp, m.tokenizer_fp)
    try:
        entry = store.read(chunks[0].kv_key).entry
        assert int(entry.positions[0]) > len(m.prefix_ids)  # stored at the positions it was computed at
    finally:
        getattr(store, "close", lambda: None)()
    again = run_index(cfg, lm=tiny_lm, embedder=embedder)  # nothing changed: nothing recomputed
    assert again.kv_chunks == 0
    other = run_index(dataclasses.replace(cfg, neighbours=NeighbourOptions(m=1, budget_tokens=64)),
                      lm=tiny_lm, embedder=embedder)
    assert other.kv_chunks == len(chunks)  # another m: other keys, computed again


def test_the_index_records_each_chunks_neighbours_and_they_name_its_key(job_config, tiny_lm, embedder):
    """What a server needs to compute a lost neighbour KV again: each chunk's neighbours (their
    tokens), recorded by the index job, whose context gives exactly the key the index recorded; a
    record that no longer names the key (neighbours changed since) gives no recipe, and an index
    from before the record (no table, opened read-only) gives none either."""
    import sqlite3

    from ragkv.indexer.job import run_index
    from ragkv.kvstore import hash_prefix
    from ragkv.retriever.chunk_db import DB_NAME, ChunkDB
    from ragkv.retriever.chunk_keys import context_ids as served_context_ids
    from ragkv.retriever.chunk_keys import neighbour_recipe
    from ragkv.retriever.manifest import read_manifest

    opts = NeighbourOptions(m=2, budget_tokens=40)
    cfg = dataclasses.replace(job_config, neighbours=opts)
    run_index(cfg, lm=tiny_lm, embedder=embedder)
    m = read_manifest(cfg.out)
    chunks = index_chunks(cfg.out)
    db = ChunkDB.open(cfg.out, readonly=True)
    try:
        recorded = db.neighbours_of([c.chunk_id for c in chunks])
    finally:
        db.close()
    assert recorded.keys() == {c.chunk_id for c in chunks}
    ph = hash_prefix(m.prefix_ids)
    for c in chunks:
        nbrs = recorded[c.chunk_id]
        assert len(nbrs) == 2 and tuple(c.token_ids) not in nbrs
        recipe = neighbour_recipe(c, nbrs, opts, ph, m.model_fp, m.tokenizer_fp)
        assert recipe is not None and recipe.neighbours == nbrs
        assert recipe.context.token_ids == tuple(served_context_ids(nbrs, 40))
        assert neighbour_recipe(c, nbrs[::-1], opts, ph, m.model_fp, m.tokenizer_fp) is None  # another context
        assert neighbour_recipe(c, nbrs, NeighbourOptions(m=2, budget_tokens=30), ph, m.model_fp,
                                m.tokenizer_fp) is None  # other options
    with sqlite3.connect(cfg.out / DB_NAME) as conn:  # an index from before the record
        conn.execute("DROP TABLE neighbours")
    db = ChunkDB.open(cfg.out, readonly=True)
    try:
        assert db.neighbours_of([c.chunk_id for c in chunks]) == {}
    finally:
        db.close()


def test_index_with_kv_context_stores_plain_kv_and_the_same_kv_as_tokens_for_one_neighbour(
        job_config, tiny_lm, embedder):
    """--neighbour-context kv: a plain pass writes every chunk's plain KV (under plain keys: it
    serves a prompt's first chunk, and it is the neighbours' context), then each chunk runs after
    its neighbour's; with m = 1 in budget that is the KV the tokens variant makes."""
    from ragkv.indexer.job import run_index
    from ragkv.indexer.kv_job import open_store
    from ragkv.retriever.chunk_keys import chunk_key
    from ragkv.retriever.manifest import read_manifest

    big = 10_000  # no neighbour is cut
    by_tokens = dataclasses.replace(job_config, out=job_config.out.parent / "tokens",
                                    neighbours=NeighbourOptions(m=1, budget_tokens=big))
    run_index(by_tokens, lm=tiny_lm, embedder=embedder)
    opts = NeighbourOptions(m=1, budget_tokens=big, context="kv")
    cfg = dataclasses.replace(job_config, neighbours=opts, plain_kv_compression="none")  # exact contexts
    s = run_index(cfg, lm=tiny_lm, embedder=embedder)
    m = read_manifest(cfg.out)
    assert m.neighbours == opts.as_dict()

    mine, theirs = ({c.chunk_id: c for c in index_chunks(out)} for out in (cfg.out, by_tokens.out))
    assert all(mine[c].kv_key != theirs[c].kv_key for c in mine)  # another context: other keys
    store = open_store([f"disk:{cfg.out / 'kv'}"], m.model_fp, m.tokenizer_fp)
    other = open_store([f"disk:{by_tokens.out / 'kv'}"], m.model_fp, m.tokenizer_fp)
    try:
        plain = [chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids) for c in mine.values()]
        stored_plain = [k for k in plain if store.contains(k)]
        assert len(stored_plain) == len(mine)  # every chunk's plain KV is in the store too
        assert s.kv_chunks == len(mine) + len(stored_plain)
        for cid, c in mine.items():
            a = store.read(c.kv_key).entry
            b = other.read(theirs[cid].kv_key).entry
            assert a.positions.tolist() == b.positions.tolist()
            torch.testing.assert_close(a.k, b.k, atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(a.v, b.v, atol=1e-4, rtol=1e-3)
    finally:
        store.close()
        other.close()
    assert run_index(cfg, lm=tiny_lm, embedder=embedder).kv_chunks == 0  # resumed: nothing again


def test_the_default_index_keeps_every_chunks_plain_kv_in_int8_within_1_5x_plain_bytes(
        job_config, tiny_lm, embedder):
    """`ragkv index`'s default (INDEX_DEFAULT: neighbour KV, plain copies for the prompt's first
    chunk) stores every chunk's plain KV int8-compressed, so the index holds at most 1.5x the
    bytes of a plain index (issue 39); the copies read back close to the plain KV."""
    from ragkv.engine import Engine
    from ragkv.indexer.job import run_index
    from ragkv.indexer.kv_job import open_store
    from ragkv.indexer.neighbours import INDEX_DEFAULT, PLAIN_COPY_COMPRESSION
    from ragkv.kvstore.fileformat import read_header
    from ragkv.retriever.chunk_keys import chunk_key
    from ragkv.retriever.manifest import read_manifest

    assert INDEX_DEFAULT.plain_first and PLAIN_COPY_COMPRESSION == "int8"
    plain_cfg = dataclasses.replace(job_config, out=job_config.out.parent / "plain")
    plain_run = run_index(plain_cfg, lm=tiny_lm, embedder=embedder)
    cfg = dataclasses.replace(job_config, neighbours=INDEX_DEFAULT)
    run = run_index(cfg, lm=tiny_lm, embedder=embedder)

    def kv_bytes(out) -> int:
        return sum(f.stat().st_size for f in (out / "kv").rglob("*.safetensors"))

    # the run's summary counts the bytes stored, int8 copies as int8 (not the float KV computed)
    assert (plain_run.kv_bytes, run.kv_bytes) == (kv_bytes(plain_cfg.out), kv_bytes(cfg.out))

    m = read_manifest(cfg.out)
    chunks = index_chunks(cfg.out)
    plain = {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids): c for c in chunks}
    files = {f.stem: f for f in (cfg.out / "kv").rglob("*.safetensors")}
    assert {k.to_str() for k in plain} <= set(files)  # every chunk's plain copy
    for k in plain:
        assert read_header(files[k.to_str()].read_bytes()).compression.value == "int8"
    for c in chunks:  # and its neighbour KV, uncompressed
        assert read_header(files[c.kv_key.to_str()].read_bytes()).compression.value == "none"
    assert kv_bytes(plain_cfg.out) < kv_bytes(cfg.out) <= 1.5 * kv_bytes(plain_cfg.out)
    store = open_store([f"disk:{cfg.out / 'kv'}"], m.model_fp, m.tokenizer_fp)
    try:
        eng = Engine(tiny_lm)
        key, c = next(iter(plain.items()))
        exact = eng.prefill(m.prefix_ids, c.token_ids)
        copy = store.read(key).entry
        torch.testing.assert_close(copy.k.float(), exact.k.float(), atol=0.05, rtol=0.05)
        assert not torch.equal(copy.k.float(), exact.k.float())  # int8, not the float values
    finally:
        store.close()


def test_eval_on_an_index_takes_neighbours_from_its_embeddings(job_config, tiny_lm, embedder, tmp_path, capsys):
    import json

    from ragkv.cli.main import main
    from ragkv.indexer.job import run_index

    run_index(job_config, lm=tiny_lm, embedder=embedder)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "a", "question": "Which planet is the hottest?", "answer": "Venus"}) + "\n")
    rc = main(["eval", "--index", str(job_config.out), "--questions", str(questions), "--model", job_config.model,
               "--top-k", "2", "--modes", "full,reuse", "--neighbours", "0,1", "--max-new-tokens", "2", "--json"])
    assert rc == 0
    modes = json.loads(capsys.readouterr().out.strip())["modes"]
    assert set(modes) == {"full", "reuse", "reuse+nb1kv"}  # the index's default context: the neighbour's plain KV
    assert {"f1", "f1_vs_full", "first_token_agreement"} <= set(modes["reuse+nb1kv"])
    assert modes["reuse+nb1kv"]["kv_prefill_median_s"] > 0


def test_one_neighbour_as_its_plain_kv_gives_the_kv_of_its_tokens(tiny_lm):
    """A neighbour's plain KV is what its tokens give after the prefix, so for one neighbour
    within the budget the cheap context (no forward of the neighbour) is the same KV."""
    from ragkv.engine import Engine
    from ragkv.engine.prefill import context_segments

    eng, prefix = Engine(tiny_lm), [1, 5, 9]
    near, far, own = [20, 21, 22, 23], [40, 41, 42], [30, 31, 32]
    near_kv, far_kv = eng.prefill(prefix, near), eng.prefill(prefix, far)
    by_tokens = eng.prefill(prefix, own, near)
    by_kv = eng.prefill(prefix, own, context_kv=context_segments([near_kv], 100))
    assert by_kv.after_context and by_kv.positions.tolist() == by_tokens.positions.tolist() == [7, 8, 9]
    torch.testing.assert_close(by_kv.k, by_tokens.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(by_kv.v, by_tokens.v, atol=1e-5, rtol=1e-4)
    # two neighbours: the nearer one's tokens no longer see the farther one, a different KV
    two = eng.prefill(prefix, own, context_kv=context_segments([near_kv, far_kv], 100))
    assert two.positions.tolist() == [10, 11, 12]
    assert not torch.allclose(two.v[1:], eng.prefill(prefix, own, far + near).v[1:], atol=1e-5)
    # the budget cuts the farthest neighbour's first tokens, as with tokens
    cut = context_segments([near_kv, far_kv], 5)
    assert [c.token_ids.tolist() for c in cut] == [[42], near]
    assert cut[0].positions.tolist() == [5]  # computed at the end of the far neighbour, re-rotated when placed
    with pytest.raises(ValueError, match="not both"):
        eng.prefill(prefix, own, near, context_kv=[near_kv])


def test_which_kv_each_mode_is_served_from() -> None:
    """The index's options decide which KV a mode reads: plain without neighbours; the
    neighbour KV for every chunk-KV mode of a neighbour index, except focus over an index that
    also stored the plain KV (`--neighbour-context kv`)."""
    from ragkv.retriever.chunk_keys import NeighbourContext, NeighbourOptions
    from ragkv.types import Mode

    plain, tokens, kv = (NeighbourOptions(), NeighbourOptions(m=1),
                         NeighbourOptions(m=1, context=NeighbourContext.KV))
    assert all(plain.serves_plain(m) for m in Mode)
    assert not any(tokens.serves_plain(m) for m in (Mode.REUSE, Mode.BLEND, Mode.FOCUS))
    assert not kv.serves_plain(Mode.BLEND) and not kv.serves_plain(Mode.REUSE)
    assert kv.serves_plain(Mode.FOCUS)
    # focus handing over to blend drops nothing it blends: the neighbour KV serves it
    assert not kv.serves_plain(Mode.FOCUS, focus_handover=True) and plain.serves_plain(Mode.FOCUS, True)
    # the prompt's first chunk follows the prefix alone: its plain KV, where the index stores one
    assert kv.plain_first and not tokens.plain_first and not plain.plain_first
    for m in (Mode.REUSE, Mode.BLEND, Mode.FOCUS):
        assert kv.serves_plain(m, focus_handover=True, first=True)
        assert not tokens.serves_plain(m, focus_handover=True, first=True)
        assert not kv.serves_plain(m, focus_handover=True)  # the later chunks: their neighbour KV
