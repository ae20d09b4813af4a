"""Blended prefill against full prefill, on tiny random models and on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import BlendOptions, Engine, Prompt, SamplingParams, load_model
from ragkv.engine.forward import LayerWork
from ragkv.evals.testing import tiny_model_dir
from ragkv.types import Mode

CHUNKS = [
    "Paris is the capital of France. The secret number is 4721.",
    "Alice met Bob by the river. The quick brown fox jumps over the lazy dog.",
    "ragkv stores the KV cache of every chunk and blends them at query time.",
    "The lazy dog sleeps. 0123456789 are digits; abc are letters.",
]
QUESTION = "What is the secret number?"


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str) -> None:
    diff = (a.float() - b.float()).abs()
    assert diff.max().item() <= atol, f"{what}: max |diff| {diff.max().item():.3g}, mean {diff.mean().item():.3g} > {atol}"


def _parts(eng: Engine, chunks=CHUNKS, question=QUESTION):
    p = eng.prompt
    prefix_ids = p.prefix_ids()
    prefix = prefix_ids
    kvs = [eng.prefill(prefix_ids, ids) for ids in [p.chunk_ids(c) for c in chunks]]
    return prefix, kvs, p.question_ids(question), p.prompt_ids(chunks, question)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny_engine(request, tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    return Engine(load_model(str(d), device="cpu", dtype="float32"))


def test_full_prefill_matches_transformers(tiny_engine):
    _, _, _, ids = _parts(tiny_engine)
    with torch.no_grad():
        ref = tiny_engine.lm.model(torch.tensor([ids])).logits[0, -1]
    assert_close(tiny_engine.run(Prompt(ids), Mode.FULL).logits, ref, 1e-4, "full vs transformers")


@pytest.mark.parametrize("mode,selector", [(Mode.BLEND, "deviation"), (Mode.BLEND, "query"),
                                           (Mode.PREFIX, "query")])
def test_ratio_one_equals_full(tiny_engine, mode, selector):
    prefix, kvs, q, ids = _parts(tiny_engine)
    full = tiny_engine.run(Prompt(ids), Mode.FULL)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), mode, options=BlendOptions(recompute_ratio=1.0, selector=selector))
    assert torch.equal(res.token_ids, full.token_ids)
    assert_close(res.logits, full.logits, 1e-4, f"{mode.value}@1.0 vs full")
    n = full.n_prompt_tokens
    assert_close(res.cache.k[:, :, :n], full.cache.k[:, :, :n], 1e-4, "cache K")
    assert_close(res.cache.v[:, :, :n], full.cache.v[:, :, :n], 1e-4, "cache V")
    assert res.recompute_fraction == 1.0


def test_reuse_of_one_chunk_equals_full(tiny_engine):
    """One chunk right after the prefix is exactly what full prefill computes: the cached,
    re-rotated KV must reproduce it (this checks RoPE at final positions end to end)."""
    prefix, kvs, q, _ = _parts(tiny_engine, CHUNKS[:1])
    ids = tiny_engine.prompt.prompt_ids(CHUNKS[:1], QUESTION)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), "reuse")
    assert_close(res.logits, tiny_engine.run(Prompt(ids), Mode.FULL).logits, 1e-4, "reuse of one chunk vs full")
    assert res.recomputed.numel() == 0


def test_reuse_of_many_chunks_differs_from_full(tiny_engine):
    """The test above could pass with a no-op: cross-chunk attention must be missing here."""
    prefix, kvs, q, ids = _parts(tiny_engine)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), "reuse")
    assert (res.logits - tiny_engine.run(Prompt(ids), Mode.FULL).logits).abs().max() > 1e-3


@pytest.mark.parametrize("selector", ["deviation", "query"])
@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5])
def test_recomputes_exactly_the_tokens_asked(tiny_engine, ratio, selector):
    prefix, kvs, q, _ = _parts(tiny_engine)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=ratio, selector=selector))
    n_chunk = sum(k.num_tokens for k in kvs)
    assert res.n_chunk_tokens == n_chunk
    assert res.recomputed.numel() == round(ratio * n_chunk)
    assert res.recomputed.unique().numel() == res.recomputed.numel()
    p = len(prefix)
    assert bool(((res.recomputed >= p) & (res.recomputed < p + n_chunk)).all())


@pytest.mark.parametrize("selector", ["deviation", "query"])
def test_blend_error_falls_as_ratio_grows(tiny_engine, selector):
    prefix, kvs, q, ids = _parts(tiny_engine)
    ref = torch.log_softmax(tiny_engine.run(Prompt(ids), Mode.FULL).logits, -1)

    def kl(ratio):
        opts = BlendOptions(recompute_ratio=ratio, selector=selector)
        out = torch.log_softmax(tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=opts).logits, -1)
        return torch.sum(ref.exp() * (ref - out)).item()

    assert kl(0.0) > kl(0.5) > kl(1.0) - 1e-6
    assert kl(1.0) < 1e-6


def test_sink_and_window_options_keep_the_budget(tiny_engine):
    prefix, kvs, q, _ = _parts(tiny_engine)
    n_chunk = sum(k.num_tokens for k in kvs)
    opts = BlendOptions(recompute_ratio=0.3, sink_tokens=2, window=4)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=opts)
    assert res.recomputed.numel() == round(0.3 * n_chunk)
    starts, off = [], len(prefix)
    for k in kvs:
        starts += [off, off + 1]
        off += k.num_tokens
    first = len(prefix) + kvs[0].num_tokens  # the first chunk's plain KV is exact here: never picked
    assert set(starts[2:]) <= set(res.recomputed.tolist()), "sink tokens were not all recomputed"
    assert not set(starts[:2]) & set(res.recomputed.tolist()) and int(res.recomputed.min()) >= first


@pytest.mark.parametrize("budget", ["global", "chunk"])
def test_query_blend_spends_its_budget_past_an_exact_first_chunk(tiny_engine, budget):
    """The first chunk's plain KV is, in the prompt, the KV full prefill computes (it follows the
    prefix alone): its tokens are never recomputed, and the same number of tokens goes to the
    others. A budget that covers every other token is then full prefill's answer."""
    prefix, kvs, q, ids = _parts(tiny_engine)
    n, first = sum(k.num_tokens for k in kvs), kvs[0].num_tokens
    p = len(prefix)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(0.3, budget=budget))
    assert res.recomputed.numel() == round(0.3 * n) and int(res.recomputed.min()) >= p + first
    rest = BlendOptions(recompute_ratio=(n - first) / n, budget=budget)
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=rest)
    assert res.recomputed.tolist() == list(range(p + first, p + n))
    assert_close(res.logits, tiny_engine.run(Prompt(ids), Mode.FULL).logits, 1e-4, "every inexact token vs full")
    # a first chunk computed after context (neighbour KV) is not exact: it is a candidate like the others
    late = tiny_engine.prefill(prefix, kvs[0].token_ids.tolist(), [7, 8, 9])
    res = tiny_engine.run(Prompt.of(prefix, [late, *kvs[1:]], q), Mode.BLEND, options=BlendOptions(0.9, budget=budget))
    assert int(res.recomputed.min()) < p + first


def test_bad_inputs_are_refused(tiny_engine, tiny_llama_dir):
    prefix, kvs, q, _ = _parts(tiny_engine)
    with pytest.raises(ValueError, match="recompute_ratio"):
        tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=1.5))
    with pytest.raises(ValueError, match="question_ids is empty"):
        tiny_engine.run(Prompt.of(prefix, kvs, []), "reuse")
    with pytest.raises(ValueError, match="prefix of"):
        tiny_engine.run(Prompt.of(kvs[0].token_ids.tolist(), kvs[1:], q), "reuse")  # chunks were computed after `prefix`
    with pytest.raises(ValueError):
        tiny_engine.run(Prompt.of(prefix, kvs, q), "sideways")
    other = Engine(load_model(str(tiny_model_dir(tiny_llama_dir.parent / "l2", num_layers=2))))
    with pytest.raises(ValueError, match="another model"):
        other.run(Prompt.of(other.prompt.prefix_ids(), kvs, q), "reuse")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_ratio_one_tracks_full(tmp_path_factory, dtype):
    d = tiny_model_dir(tmp_path_factory.mktemp("half"), "llama", seed=3)
    eng = Engine(load_model(str(d), device="cpu", dtype=dtype))
    prefix, kvs, q, ids = _parts(eng)
    assert kvs[0].k.dtype == getattr(torch, dtype)
    full = eng.run(Prompt(ids), Mode.FULL)
    res = eng.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=1.0))
    assert_close(res.logits, full.logits, 0.1, f"{dtype} blend@1.0 vs full")


@pytest.mark.real_model
def test_smollm2_ratio_one_equals_full(smollm2):
    eng = Engine(smollm2)
    chunks = [c * 6 for c in CHUNKS]
    prefix, kvs, q, ids = _parts(eng, chunks)
    full = eng.run(Prompt(ids), Mode.FULL)
    with torch.no_grad():
        ref = smollm2.model(torch.tensor([ids])).logits[0, -1]
    assert_close(full.logits, ref, 1e-4, "SmolLM2 full vs transformers")
    res = eng.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=1.0))
    assert_close(res.logits, full.logits, 1e-4, "SmolLM2 blend@1.0 vs full")
    part = eng.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=0.15))
    assert part.recomputed.numel() == round(0.15 * part.n_chunk_tokens)


@pytest.mark.real_model
def test_smollm2_chunked_prefill_gives_whole_layers_answer(smollm2):
    """Steps of at most 64 prompt tokens (`Engine.step_tokens`) against whole layers, on the
    real model: full prefill and query blend agree to float noise and greedy-decode the same."""
    whole, cut = Engine(smollm2, step_tokens=0), Engine(smollm2, step_tokens=64)
    prefix, kvs, q, ids = _parts(whole, [c * 2 for c in CHUNKS])
    assert len(ids) > 3 * 64, len(ids)
    half = BlendOptions(recompute_ratio=0.5)  # the picked tokens and the question: more rows than a step
    for prompt, mode in ((Prompt(ids), Mode.FULL), (Prompt.of(prefix, kvs, q), Mode.BLEND)):
        a, b = whole.run(prompt, mode, half), cut.run(prompt, mode, half)
        assert torch.equal(a.recomputed, b.recomputed)
        assert mode is Mode.FULL or a.recomputed.numel() + len(q) > 64  # blend too runs in pieces
        assert_close(b.logits, a.logits, 1e-4, f"SmolLM2 {mode.value} cut vs whole")
        streams = [whole.decode(r, SamplingParams(max_new_tokens=16)) for r in (a, b)]
        texts = ["".join(stream) for stream in streams]  # decoded to the end
        assert texts[0] == texts[1] and streams[0].token_ids == streams[1].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_ratio_one_equals_full(tiny_llama_dir, dtype):
    eng = Engine(load_model(str(tiny_llama_dir), device="cuda", dtype=dtype))
    prefix, kvs, q, ids = _parts(eng)
    full = eng.run(Prompt(ids), Mode.FULL)
    res = eng.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=1.0))
    assert_close(res.logits, full.logits, 1e-4 if dtype == "float32" else 0.1, f"cuda {dtype}")


@pytest.mark.parametrize("ratio", [0.0, 0.2, 1.0])
def test_query_selector_budget_and_exactness(tiny_engine, ratio):
    prefix, kvs, q, ids = _parts(tiny_engine)
    opts = BlendOptions(recompute_ratio=ratio, selector="query")
    res = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=opts)
    assert res.recomputed.numel() == round(ratio * res.n_chunk_tokens)
    assert "score" in res.timings
    if ratio == 1.0:
        assert_close(res.logits, tiny_engine.run(Prompt(ids), Mode.FULL).logits, 1e-4, "query@1.0 vs full")


def test_query_selector_prefers_what_the_question_attends(tiny_engine):
    from ragkv.engine.select import question_attention  # noqa: F401  (the scores come from there)

    prefix, kvs, q, ids = _parts(tiny_engine)
    a = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=0.3, selector="query"))
    b = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(recompute_ratio=0.3, selector="deviation"))
    assert not torch.equal(a.recomputed, b.recomputed), "query and deviation picked the same tokens"


def test_adaptive_budget_stays_within_bounds(tiny_engine):
    prefix, kvs, q, _ = _parts(tiny_engine)
    n = sum(k.num_tokens for k in kvs)
    for mass in (0.05, 0.5, 0.99):
        opts = BlendOptions(recompute_ratio=0.6, min_ratio=0.1, adaptive_mass=mass, selector="query")
        r = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=opts).recomputed.numel()
        assert round(0.1 * n) <= r <= round(0.6 * n)
    small = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(
        recompute_ratio=0.6, adaptive_mass=0.05, selector="query")).recomputed.numel()
    large = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(
        recompute_ratio=0.6, adaptive_mass=0.99, selector="query")).recomputed.numel()
    assert small < large


def test_quality_guard_falls_back_to_full_only_when_the_budget_is_short(tiny_engine):
    prefix, kvs, q, ids = _parts(tiny_engine)
    full = tiny_engine.run(Prompt(ids), Mode.FULL)
    # holding all of the attention needs every scored token: more than a 0.2 budget
    guarded = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(
        recompute_ratio=0.2, adaptive_mass=1.0, selector="query", fallback_full=True))
    assert guarded.mode.value == "full" and guarded.recompute_fraction == 1.0
    assert "score" in guarded.timings  # the scores were read, then the guard fired
    assert_close(guarded.logits, full.logits, 1e-4, "guarded request vs full prefill")
    # a tiny share of the attention fits the budget: the request blends as usual
    kept = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(
        recompute_ratio=0.2, adaptive_mass=1e-6, selector="query", fallback_full=True))
    assert kept.mode.value == "blend" and 0 < kept.recompute_fraction < 0.2
    with pytest.raises(ValueError, match="fallback_full"):
        BlendOptions(fallback_full=True)  # no mass to guard
    with pytest.raises(ValueError, match="fallback_full"):
        BlendOptions(adaptive_mass=0.5, selector="deviation", fallback_full=True)


def test_context_temperature_changes_only_reused_keys(tiny_engine):
    prefix, kvs, q, ids = _parts(tiny_engine)
    full = tiny_engine.run(Prompt(ids), Mode.FULL).logits
    hot = tiny_engine.run(Prompt.of(prefix, kvs, q), "reuse", options=BlendOptions(0.0, context_temperature=1.5))
    plain = tiny_engine.run(Prompt.of(prefix, kvs, q), "reuse")
    assert (hot.logits - plain.logits).abs().max() > 1e-4
    exact = tiny_engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=BlendOptions(1.0, context_temperature=1.5))
    assert_close(exact.logits, full, 1e-4, "every token recomputed: the temperature is gone")
    with pytest.raises(ValueError, match="context_temperature"):
        BlendOptions(context_temperature=0.0)


def test_step_rows_are_sized_from_the_measured_speed(tiny_engine):
    """With no `step_tokens` given, a step is the rows of one layer that take `step_s` at the
    engine's measured full prefill rate (its chunk prefill rate before that), 2048 at least: a
    fast engine runs long prompts' layers whole, a slow one keeps pieces of 2048; a set
    `step_tokens` wins."""
    from ragkv.engine.runtime import DEFAULT_STEP_TOKENS

    eng = Engine(tiny_engine.lm, step_s=0.05)
    layers = eng.lm.num_layers
    assert eng.step_rows() == DEFAULT_STEP_TOKENS  # nothing measured yet
    eng.speed.observe(500_000, 1.0)  # chunk prefill: 500K tokens a second through every layer
    assert eng.step_rows() == int(500_000 * layers * 0.05) > DEFAULT_STEP_TOKENS
    eng.speed.observe_prompt(Mode.FULL, 400_000, 1.0)  # full prefill's own rate comes first
    assert eng.step_rows() == int(400_000 * layers * 0.05)
    eng.step_tokens = 64
    assert eng.step_rows() == 64
    slow = Engine(tiny_engine.lm)
    slow.speed.observe_prompt(Mode.FULL, 10, 1.0)
    assert slow.step_rows() == DEFAULT_STEP_TOKENS
    # the size reaches the pass: each prompt's steps are at most the rows step_rows gives then
    slow.step_rows = lambda: 7  # type: ignore[method-assign]
    _, _, _, ids = _parts(slow)
    steps = [s.rows for s in slow.run_steps(Prompt(ids), Mode.FULL) if isinstance(s, LayerWork)]
    assert len(ids) > 7 and max(steps) <= 7, steps
    with pytest.raises(ValueError, match="step_s must be > 0"):
        Engine(tiny_engine.lm, step_s=0)
