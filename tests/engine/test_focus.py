"""FOCUS mode: chunk relevance from the question's attention, and exactness of what it runs."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, load_model
from ragkv.engine.focus import chunk_relevance, focus_layers, pick_chunks, spread
from ragkv.evals.synthetic import make_cases
from ragkv.evals.testing import tiny_model_dir
from ragkv.types import Mode

CHUNKS = ["alpha beta gamma delta epsilon " * 8, "one two three four five six " * 9, "red green blue cyan " * 7]
QUESTION = "what comes after alpha?"


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny(tmp_path_factory, request):
    d = tiny_model_dir(tmp_path_factory.mktemp(f"focus-{request.param}"), request.param, num_layers=6, seed=3)
    return Engine(load_model(str(d), device="cpu", dtype="float32"))


def _parts(eng: Engine, chunks=CHUNKS, question=QUESTION):
    p = eng.prompt
    prefix_ids = p.prefix_ids()
    kvs = [eng.prefill(prefix_ids, ids) for ids in [p.chunk_ids(c) for c in chunks]]
    return prefix_ids, kvs, p.question_ids(question)


def test_focus_layers_default_band_and_clamping():
    assert focus_layers(30) == range(20, 24)
    assert focus_layers(4) == range(3, 4)  # never empty, never past the last layer
    assert focus_layers(30, (5, 9)) == range(5, 9)
    assert focus_layers(6, (4, 40)) == range(4, 6)


def test_pick_chunks_keeps_prompt_order_and_threshold():
    rel = torch.tensor([0.2, 1.0, 0.6, 0.49])
    assert pick_chunks(rel, 1.0) == [1]
    assert pick_chunks(rel, 0.5) == [1, 2]
    assert pick_chunks(rel, 0.1) == [0, 1, 2, 3]


def test_spread_is_the_runners_up_mean_over_the_best():
    assert spread(torch.tensor([0.2, 1.0, 0.6])) == pytest.approx(0.4)
    assert spread(torch.tensor([0.5, 0.25])) == pytest.approx(0.5)  # the best need not be 1; one runner-up
    # the two runners-up alone: more distractors below them do not lower it
    assert spread(torch.tensor([0.9, 1.0, 0.1, 0.7, 0.1, 0.1])) == pytest.approx(0.8)
    assert spread(torch.tensor([0.9, 1.0, 0.7])) == pytest.approx(0.8)
    assert spread(torch.tensor([0.7])) == 0.0  # a lone chunk has no runner-up


def test_bad_focus_options_are_refused():
    with pytest.raises(ValueError, match="focus_keep"):
        FocusOptions(keep=0.0)
    with pytest.raises(ValueError, match="focus_spread"):
        FocusOptions(spread=1.5)
    with pytest.raises(ValueError, match="focus_band"):
        FocusOptions(band=(5, 5))


def test_one_kept_chunk_is_exact_prefill_of_the_focused_prompt(tiny):
    prefix, kvs, q = _parts(tiny)
    # ratio 1.0: should scores ever tie at the top, the kept chunks are recomputed exactly too
    res = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(recompute_ratio=1.0, focus=FocusOptions(keep=1.0)))
    assert res.mode.value == "focus" and res.used_chunks is not None
    assert 1 <= len(res.used_chunks) < len(CHUNKS), f"keep 1.0 kept {res.used_chunks}"
    kept = [CHUNKS[i] for i in res.used_chunks]
    ref = tiny.run(Prompt(tiny.prompt.prompt_ids(kept, QUESTION)), Mode.FULL)
    assert torch.equal(res.token_ids, torch.tensor(tiny.prompt.prompt_ids(kept, QUESTION)))
    assert (res.logits - ref.logits).abs().max() <= 1e-4, f"kept {res.used_chunks}"
    if len(kept) == 1:  # one kept chunk is plain reuse: nothing recomputed
        assert res.recompute_fraction == 0.0
    assert "focus" in res.timings and res.n_chunk_tokens == sum(k.num_tokens for k in kvs)


def test_low_keep_at_ratio_one_equals_full_prefill_of_what_it_kept(tiny):
    prefix, kvs, q = _parts(tiny)
    res = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(recompute_ratio=1.0, focus=FocusOptions(keep=1e-9)))
    top = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(focus=FocusOptions(keep=1.0)))
    assert set(top.used_chunks) <= set(res.used_chunks)
    ref = tiny.run(Prompt(tiny.prompt.prompt_ids([CHUNKS[i] for i in res.used_chunks], QUESTION)), Mode.FULL)
    assert (res.logits - ref.logits).abs().max() <= 1e-4
    # decoding continues from the focused cache like from any other mode
    assert len(list(tiny.decode(res))) > 0


def test_relevance_is_normalized_and_the_best_chunk_is_one(tiny):
    prefix, kvs, q = _parts(tiny)
    rel = chunk_relevance(tiny.lm, tiny.prefix_kv(prefix), kvs, torch.tensor(q), focus_layers(tiny.lm.num_layers))
    assert rel.shape == (3,)
    assert float(rel.max()) == pytest.approx(1.0) and float(rel.min()) > 0


def test_smollm2_focus_finds_the_needle_chunk(smollm2):
    """Retrieval heads in layers 20-23 point at the chunk that holds the asked-for fact."""
    eng = Engine(smollm2)
    tok = smollm2.tokenizer
    cases = make_cases("niah", 4, 4, 160, lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), seed=1)
    found = 0
    for case in cases:
        prefix, kvs, q = _parts(eng, list(case.chunks), case.question)
        needle = next(i for i, c in enumerate(case.chunks) if case.answers[0] in c)
        rel = chunk_relevance(smollm2, eng.prefix_kv(prefix), kvs, torch.tensor(q), focus_layers(smollm2.num_layers))
        found += int(rel.argmax()) == needle
    assert found >= 3, f"the needle chunk scored highest in only {found} of 4 cases"


@pytest.mark.parametrize("garbage", [float("nan"), 1e30])
def test_question_attention_never_reads_unwritten_cache_slots(tiny, garbage):
    """The cache's question slots are uninitialized memory until the pass writes them: scores
    must come out the same whatever they held (CI once saw NaN there and focus kept nothing)."""
    from ragkv.engine.kv.cache import KVCache
    from ragkv.engine.select import question_attention

    lm = tiny.lm
    prefix, kvs, q = _parts(tiny)
    segments = [tiny.prefix_kv(prefix), *kvs]
    ids = torch.cat([s.token_ids for s in segments] + [torch.tensor(q)])  # [N]
    n, c = ids.shape[0], ids.shape[0] - len(q)
    rope = lm.adapter.rotary(torch.arange(n), torch.empty(0, dtype=lm.dtype))
    layers = list(range(lm.num_layers))

    def scores(fill: float) -> torch.Tensor:
        cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, lm.device)
        cache.k.fill_(fill)
        cache.v.fill_(fill)
        cache.length = n
        cache.write_segments(segments, rope)
        return question_attention(lm, ids, cache, rope, c, layers)  # [L, c]

    clean, dirty = scores(0.0), scores(garbage)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean)


def test_handover_blends_every_chunk_when_several_are_kept(tiny):
    """With focus_handover, keeping several chunks means the question needs several passages:
    none is dropped, and the prompt is blend's over them all (at ratio 1.0: full prefill of
    the whole prompt); keeping one chunk is unchanged."""
    prefix, kvs, q = _parts(tiny)
    several = BlendOptions(recompute_ratio=1.0, focus=FocusOptions(keep=1e-9, handover=True, spread=0.0))
    res = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=several)
    assert res.used_chunks == (0, 1, 2)
    blend = tiny.run(Prompt.of(prefix, kvs, q), "blend", options=BlendOptions(recompute_ratio=1.0))
    full = tiny.run(Prompt(tiny.prompt.prompt_ids(CHUNKS, QUESTION)), Mode.FULL)
    assert torch.equal(res.logits, blend.logits)
    assert (res.logits - full.logits).abs().max() <= 1e-4
    assert res.chunk_scores is not None and len(res.chunk_scores) == 3 and max(res.chunk_scores) > 0.99
    one = BlendOptions(focus=FocusOptions(keep=1.0, handover=True, spread=0.0))
    alone, before = (tiny.run(Prompt.of(prefix, kvs, q), "focus", options=o)
                     for o in (one, BlendOptions(focus=FocusOptions(keep=1.0))))
    assert len(alone.used_chunks) == 1 and alone.used_chunks == before.used_chunks
    assert torch.equal(alone.logits, before.logits)


def test_one_kept_neighbour_chunk_is_recomputed_exactly_at_lookup_ratio_one(tiny):
    """A chunk whose KV was computed after neighbours that the prompt does not hold is not
    reused as exact: focus keeping only it at lookup ratio 1.0 recomputes it, which is full
    prefill of the prefix, that chunk and the question."""
    p = tiny.prompt
    prefix, plain, q = _parts(tiny)
    ids = [p.chunk_ids(c) for c in CHUNKS]
    # each chunk after the next one's tokens: KV that has attended to a neighbour
    nb = [tiny.prefill(prefix, ids[i], context_ids=ids[(i + 1) % 3]) for i in range(3)]
    assert all(kv.after_context for kv in nb)
    res = tiny.run(Prompt.of(prefix, nb, q), "focus",
                   options=BlendOptions(focus=FocusOptions(keep=1.0, lookup_ratio=1.0)))
    assert res.used_chunks is not None and len(res.used_chunks) == 1  # keep 1.0: the best alone
    kept = [CHUNKS[res.used_chunks[0]]]
    ref = tiny.run(Prompt(p.prompt_ids(kept, QUESTION)), Mode.FULL)
    assert (res.logits - ref.logits).abs().max() <= 1e-4
    assert res.recompute_fraction > 0


def test_handover_waits_for_the_spread(tiny):
    """focus_spread: several kept chunks hand over only when the others score on average at
    least that share of the best; below it, focus answers over the kept chunks alone."""
    prefix, kvs, q = _parts(tiny)
    base = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(focus=FocusOptions(keep=1e-9)))
    scores = sorted(base.chunk_scores, reverse=True)
    assert scores[0] > scores[1] > scores[2], base.chunk_scores
    keep = (scores[1] + scores[2]) / 2 / scores[0]  # the best two kept, the third dropped
    s = spread(torch.tensor(base.chunk_scores))
    # (the share of chunks kept never hands over here, most 1.0; a lookup keeps what `keep` kept)
    rules = dict(keep=keep, handover=True, several=0, lookup_keep=None)
    below = BlendOptions(focus=FocusOptions(spread=min(1.0, s + 1e-3), **rules))
    above = BlendOptions(focus=FocusOptions(spread=max(0.0, s - 1e-3), **rules))
    kept = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=below)
    assert kept.used_chunks is not None and len(kept.used_chunks) == 2
    handed = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=above)
    blend = tiny.run(Prompt.of(prefix, kvs, q), "blend", options=BlendOptions())
    assert handed.used_chunks == (0, 1, 2) and torch.equal(handed.logits, blend.logits)


def test_several_kept_neighbour_chunks_are_recomputed_exactly(tiny):
    """Several kept chunks whose KV attended to neighbours the prompt does not hold, with no
    handover, at lookup ratio 1.0: recomputed, so the answer is full prefill of the prefix, the kept
    chunks and the question."""
    p = tiny.prompt
    prefix, _, q = _parts(tiny)
    ids = [p.chunk_ids(c) for c in CHUNKS]
    nb = [tiny.prefill(prefix, ids[i], context_ids=ids[(i + 1) % 3]) for i in range(3)]
    opts = BlendOptions(focus=FocusOptions(keep=1e-9, lookup_ratio=1.0, lookup_keep=None))
    res = tiny.run(Prompt.of(prefix, nb, q), "focus", options=opts)
    assert res.used_chunks == (0, 1, 2) and not res.handed_over
    ref = tiny.run(Prompt(p.prompt_ids(CHUNKS, QUESTION)), Mode.FULL)
    assert (res.logits - ref.logits).abs().max() <= 1e-4


def test_a_lookup_over_neighbour_kv_blends_its_kept_chunks_at_the_lookup_ratio(tiny):
    """A lookup over neighbour KV recomputes only the lookup ratio's share of its kept chunks,
    picked by the question's attention that focus's pass read; with no lookup ratio, the request's
    ratio of them. More recompute brings it closer to full prefill over the kept chunks."""
    p = tiny.prompt
    prefix, _, q = _parts(tiny)
    ids = [p.chunk_ids(c) for c in CHUNKS]
    nb = [tiny.prefill(prefix, ids[i], context_ids=ids[(i + 1) % 3]) for i in range(3)]
    runs = {r: tiny.run(Prompt.of(prefix, nb, q), "focus",
                        options=BlendOptions(recompute_ratio=0.3, focus=FocusOptions(keep=1.0, lookup_ratio=r)))
            for r in (None, 0.1, 0.5, 1.0)}
    kept = runs[1.0].used_chunks
    assert kept is not None and len(kept) == 1 and all(r.used_chunks == kept for r in runs.values())
    kept_tokens = nb[kept[0]].num_tokens
    for r, res in runs.items():
        share = 0.3 if r is None else r
        assert res.recomputed.numel() == round(share * kept_tokens), r
        assert not res.handed_over
    ref = tiny.run(Prompt(p.prompt_ids([CHUNKS[kept[0]]], QUESTION)), Mode.FULL)
    err = {r: float((res.logits - ref.logits).abs().max()) for r, res in runs.items()}
    assert err[1.0] <= 1e-4 < err[0.1] and err[0.5] < err[0.1], err
    with pytest.raises(ValueError, match="focus_lookup_ratio"):
        FocusOptions(lookup_ratio=1.5)


def test_focus_scoring_pass_reads_the_blend_selectors_scores(tiny):
    """The attention focus's one pass reads at the query selector's layer equals the selector's
    own pass over the same cache: a handover picks the same tokens a blend does, bit for bit."""
    from ragkv.engine.focus import score_chunks

    prefix, kvs, q = _parts(tiny)
    lm = tiny.lm
    mid = lm.adapter.scoring_layers([lm.num_layers // 2])
    with_tokens = score_chunks(lm, tiny.prefix_kv(prefix), kvs, torch.tensor(q), focus_layers(lm.num_layers), mid)
    alone = score_chunks(lm, tiny.prefix_kv(prefix), kvs, torch.tensor(q), focus_layers(lm.num_layers))
    assert torch.equal(with_tokens.relevance, alone.relevance) and alone.tokens is None
    assert with_tokens.tokens.shape == (sum(kv.num_tokens for kv in kvs),)
    assert float(with_tokens.tokens.sum()) > 0


def test_a_lookup_keeps_the_chunks_near_the_best_at_the_lookup_keep(tiny):
    """lookup_keep: a lookup (no handover) answers over the chunks scoring at least that x the best
    (1.0: the best alone), whatever `keep` kept; a handover still blends every chunk."""
    prefix, kvs, q = _parts(tiny)
    loose = BlendOptions(focus=FocusOptions(keep=1e-9, lookup_keep=None))
    base = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=loose)
    assert base.used_chunks == (0, 1, 2)
    best = max(range(3), key=lambda i: base.chunk_scores[i])
    alone = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(focus=FocusOptions(keep=1e-9, lookup_keep=1.0)))
    assert alone.used_chunks == (best,)
    ref = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(focus=FocusOptions(keep=1.0)))
    assert torch.equal(alone.logits, ref.logits)  # the best alone, as keep 1.0 answers
    handed = tiny.run(Prompt.of(prefix, kvs, q), "focus",
                      options=BlendOptions(focus=FocusOptions(keep=1e-9, handover=True, spread=0.0, lookup_keep=1.0)))
    assert handed.handed_over and handed.used_chunks == (0, 1, 2)
    with pytest.raises(ValueError, match="focus_lookup_keep"):
        FocusOptions(lookup_keep=0.0)


def test_a_lookup_keeps_a_first_chunk_served_from_its_plain_kv(tiny):
    """Over the default index the prompt's first chunk is served from its plain KV and the others
    from their neighbour KV: a lookup keeps that first chunk whatever it scores (its KV is exact,
    and its score, read over exact KV beside neighbour KV, is not comparable), spending none of its
    budget on it; over plain KV alone (or neighbour KV alone) a lookup keeps only the chunks it picks."""
    p = tiny.prompt
    prefix, plain, q = _parts(tiny)
    ids = [p.chunk_ids(c) for c in CHUNKS]
    nb = [tiny.prefill(prefix, ids[i], context_ids=ids[(i + 1) % 3]) for i in range(3)]
    # the best alone, blended at the request's ratio of the kept chunks' tokens
    lookup = BlendOptions(recompute_ratio=0.3, focus=FocusOptions(keep=1.0, lookup_ratio=None))
    for kvs in (plain, nb):  # one kind of KV: the best alone
        res = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=lookup)
        assert res.used_chunks is not None and len(res.used_chunks) == 1
    mixed = [plain[0], *nb[1:]]
    scores = tiny.run(Prompt.of(prefix, mixed, q), "focus", options=lookup).chunk_scores
    best = max(range(3), key=lambda i: scores[i])
    res = tiny.run(Prompt.of(prefix, mixed, q), "focus", options=lookup)
    assert res.used_chunks == ((0,) if best == 0 else (0, best))
    first = len(prefix) + plain[0].num_tokens
    if best != 0:  # the best blended at the request's ratio of the kept tokens, none of them the first's
        assert res.recomputed.numel() == round(0.3 * (plain[0].num_tokens + nb[best].num_tokens))
        assert int(res.recomputed.min()) >= first


def test_a_lookup_that_keeps_every_chunk_is_the_handovers_blend(tiny):
    """A lookup keeping every chunk at the request's ratio is blend over them all: it runs as the
    handover does, over the cache the scoring pass read, and answers as blend does."""
    prefix, kvs, q = _parts(tiny)
    never = FocusOptions(keep=1e-9, handover=True, spread=1.0)  # no spread reaches 1.0: a lookup of all 3
    res = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(recompute_ratio=0.3, focus=never))
    blend = tiny.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=0.3))
    assert res.handed_over and res.used_chunks == (0, 1, 2)
    assert torch.equal(res.logits, blend.logits) and torch.equal(res.recomputed, blend.recomputed)
    # whatever its lookup ratio and lookup keep: it drops nothing, so it is no lookup
    for focus in (FocusOptions(keep=1e-9, handover=True, spread=1.0, several=0, lookup_keep=None, lookup_ratio=0.5),
                  FocusOptions(keep=1e-9, handover=True, spread=1.0, several=0, lookup_keep=None)):
        own = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(recompute_ratio=0.3, focus=focus))
        assert own.handed_over and torch.equal(own.logits, blend.logits)


def test_a_question_keeping_several_chunks_hands_over_whatever_the_spread(tiny):
    """FocusOptions.several: when at least that many chunks score within `keep` of the best, several
    passages matter: focus hands over (blends every chunk) even below the spread; fewer, it is a lookup."""
    prefix, kvs, q = _parts(tiny)
    base = tiny.run(Prompt.of(prefix, kvs, q), "focus", options=BlendOptions(focus=FocusOptions(keep=1e-9)))
    scores = sorted(base.chunk_scores, reverse=True)
    assert scores[0] > scores[1] > scores[2], base.chunk_scores
    keep = (scores[1] + scores[2]) / 2 / scores[0]  # two of the three kept
    runs = {n: tiny.run(Prompt.of(prefix, kvs, q), "focus",
                        options=BlendOptions(focus=FocusOptions(keep=keep, handover=True, spread=1.0, several=n)))
            for n in (2, 3, 0)}
    blend = tiny.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions())
    assert runs[2].handed_over and runs[2].used_chunks == (0, 1, 2)
    assert torch.equal(runs[2].logits, blend.logits)
    for n in (3, 0):
        assert not runs[n].handed_over and len(runs[n].used_chunks) == 1  # the best alone (lookup_keep 1.0)
    for bad in (1, -1):
        with pytest.raises(ValueError, match="focus_several"):
            FocusOptions(several=bad)


def test_the_default_lookup_reuses_its_chunks_kv_as_stored(tiny):
    """The default lookup over the default index (first chunk plain, the others neighbour KV): the
    best chunk alone (lookup_keep 1.0) beside the first, their KV reused with no recompute
    (lookup_ratio 0.0): only the question is computed, as reuse over those chunks computes it."""
    p = tiny.prompt
    prefix, plain, q = _parts(tiny)
    ids = [p.chunk_ids(c) for c in CHUNKS]
    nb = [tiny.prefill(prefix, ids[i], context_ids=ids[(i + 1) % 3]) for i in range(3)]
    mixed = [plain[0], *nb[1:]]
    defaults = FocusOptions()
    assert defaults.lookup_ratio == 0.0 and defaults.lookup_keep == 1.0
    lookup = BlendOptions(focus=FocusOptions(handover=True, spread=1.0, several=0))  # no handover: a lookup
    res = tiny.run(Prompt.of(prefix, mixed, q), "focus", options=lookup)
    best = max(range(3), key=lambda i: res.chunk_scores[i])
    assert not res.handed_over and res.used_chunks == ((0,) if best == 0 else (0, best))
    assert res.recomputed.numel() == 0 and res.recompute_fraction == 0.0
    ref = tiny.run(Prompt.of(prefix, [mixed[i] for i in res.used_chunks], q), Mode.REUSE)
    assert torch.allclose(res.logits, ref.logits, atol=1e-5), float((res.logits - ref.logits).abs().max())
