"""Every served model family, on a tiny random-weight model built from transformers' own
config class (no downloads), with each feature its adapter handles switched on (windows
that the prompts cross, q/k norms, MoE, multipliers, soft-capping, sinks, per-layer
rotary) and its 1-D weights (norms, biases, sinks) randomized, so that a norm in the
wrong place or a missing multiplier shows in the logits.

What each test holds:
- full prefill logits equal transformers' forward (fp32, max abs diff <= 1e-4);
- blend at ratio 1.0 equals full (<= 1e-5), a chunk reused at its own positions equals full;
- greedy decode equals transformers' `generate` for 16 tokens;
- batched decode (a ragged batch, one layer function) equals each request alone;
- bfloat16 on the CPU: no further from the fp32 logits than transformers' own bfloat16
  forward, within 1.5x (see `test_bfloat16_is_as_close_to_float32_as_transformers`);
- blend at 0.15 has lower KL to full than reuse.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragkv.engine import Prompt, TreeConfig, load_model
from ragkv.engine.blend import BlendOptions
from ragkv.engine.check import check_model
from ragkv.engine.decode import decode_batch
from ragkv.engine.decode_graphs import unsupported_reason
from ragkv.engine.family import FAMILIES, Adapter, _lm_head
from ragkv.engine.forward import LayerWork, drain_together
from ragkv.engine.runtime import Engine
from ragkv.engine.work import drain
from ragkv.evals.testing import FAMILY_CONFIGS, HYBRIDS, tiny_model_dir
from ragkv.types import Mode

NAMES = sorted(FAMILY_CONFIGS)
HYBRID_NAMES = sorted(HYBRIDS)  # FULL only: the chunk-KV tests run on the others
CHUNK_KV_NAMES = [n for n in NAMES if n not in HYBRIDS]
TEXTS = ("The archive keeps the secret number 4721 in a sealed box.",
         "Alice met Bob in Paris, the capital of France, on a quiet day.",
         "The quick brown fox jumps over the lazy dog near the river bank.",
         "ragkv stores the KV cache of every chunk and blends them.")
QUESTIONS = ("What is the secret number?", "Where did Alice meet Bob?", "What does the fox do?")

_MODELS: dict[tuple[str, str, float], object] = {}


def _lm(tmp_path_factory, name: str, dtype: str = "float32", init: float = 0.2, **overrides):
    key = (name, dtype, init, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        d = tiny_model_dir(tmp_path_factory.mktemp(name), name, family=True, initializer_range=init, **overrides)
        _MODELS[key] = load_model(str(d), device="cpu", dtype=dtype)
    return _MODELS[key]


def test_every_family_has_a_test_config():
    served = {FAMILY_CONFIGS[n][0] for n in NAMES}
    import transformers

    types = {getattr(transformers, cls).model_type for cls in served}
    assert types == set(FAMILIES), f"families without a tiny config: {set(FAMILIES) - types}"
    recurrent = {n for n in NAMES if FAMILIES[getattr(transformers, FAMILY_CONFIGS[n][0]).model_type].recurrent}
    assert recurrent == HYBRIDS


@pytest.mark.parametrize("name", NAMES)
def test_gate_passes_with_exact_numbers(tmp_path_factory, name):
    lm = _lm(tmp_path_factory, name)
    checks = {c.name: c for c in check_model(lm)}
    assert all(c.passed for c in checks.values()), "\n".join(c.line() for c in checks.values())
    assert checks["logits vs transformers"].value <= 1e-4
    assert checks["greedy decode vs generate"].value == 16  # tokens compared, all equal
    if unsupported_reason(lm.adapter) is None:  # decodes over one pool on CUDA: that path is gated too
        assert checks["pooled decode vs generate"].value == 16
    else:
        assert "pooled decode vs generate" not in checks
    if name in HYBRIDS:  # no chunk KV to check: the gate says nothing of modes a hybrid is not served in
        assert set(checks) == {"logits vs transformers", "greedy decode vs generate"}
    else:
        assert checks["blend at 1.0 vs full"].value <= 1e-5
        assert checks["reused chunk vs full"].value <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_batched_decode_equals_alone(tmp_path_factory, name):
    lm = _lm(tmp_path_factory, name)
    engine = Engine(lm)
    fmt = engine.prompt
    prompts = [[*fmt.prefix_ids(), *fmt.chunk_ids(t), *fmt.question_ids(q)] for t, q in zip(TEXTS, QUESTIONS)]
    res = [engine.run(Prompt(ids), Mode.FULL, reserve_tokens=8) for ids in prompts]  # lengths differ: a ragged batch
    alone = [engine.run(Prompt(ids), Mode.FULL, reserve_tokens=8) for ids in prompts]
    tokens = [int(r.logits.argmax()) for r in res]
    for _ in range(6):
        batched = decode_batch(lm, [r.cache for r in res], tokens)  # [B, V]
        single = torch.stack([decode_batch(lm, [a.cache], [t])[0] for a, t in zip(alone, tokens)])  # [B, V]
        # B rows through one GEMM sum in another order than one row, and an MoE block gathers other
        # rows per expert: float noise of the logits' scale (Qwen3.5 MoE's tiny config reaches 1.03e-5
        # of it on torch 2.13 CPU, so the bound is 1e-4: float32 noise, far below any real difference)
        torch.testing.assert_close(batched, single, atol=1e-4 * max(1.0, float(single.abs().max())), rtol=0)
        assert batched.argmax(-1).tolist() == single.argmax(-1).tolist()
        tokens = batched.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 65])
def test_the_lm_head_of_a_few_rows_equals_the_module(rows, dtype):
    # a batched decode step's rows take the head as W @ h^T on CPU (family._lm_head): the same
    # logits as the module within float rounding, bias included; one row, more rows than a decode
    # batch and a bf16 head run the module itself, bit for bit
    g = torch.Generator().manual_seed(rows)
    head = torch.nn.Linear(48, 1000, bias=True).to(dtype)
    with torch.no_grad():
        head.bias.normal_(generator=g)
    h = torch.randn(rows, 48, generator=g).to(dtype)  # [S, hidden]
    with torch.inference_mode():
        got, want = _lm_head(head, h), head(h)  # [S, V]
    assert got.shape == (rows, 1000)
    if rows == 1 or rows > 64 or dtype != torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_is_as_close_to_float32_as_transformers(tmp_path_factory, name):
    """The dtype half of the GPU path, on the CPU. bfloat16 keeps 8 bits of mantissa, so every
    product rounds at ~0.4% and the last logits of a 4-layer model drift by ~1% of their
    scale from float32, in transformers as in ragkv; the two differ in rounding order
    (ragkv's soft-capped and sink attention takes its softmax in float32; OLMo 2's float32
    rotary tables are cast to bfloat16 first), so neither is the reference for the other.
    The criterion: ragkv in bfloat16 is no further from the float32 logits than
    transformers' own bfloat16 forward, within 1.5x (+1e-3). Weights at a realistic scale
    (init 0.05): at the stress scale of the other tests (0.2) a 4-layer random model is
    chaotic in bfloat16 (a router near-tie flips an expert), in transformers too."""
    lm32 = _lm(tmp_path_factory, name, init=0.05)
    lm16 = _lm(tmp_path_factory, name, dtype="bfloat16", init=0.05)
    fmt = Engine(lm32).prompt
    ids = [*fmt.prefix_ids(), *(t for x in TEXTS for t in fmt.chunk_ids(x)), *fmt.question_ids(QUESTIONS[0])]
    ref = lm32.model(torch.tensor([ids])).logits[0, -1].float()  # [V]
    theirs = lm16.model(torch.tensor([ids])).logits[0, -1].float()
    ours = Engine(lm16).run(Prompt(ids), Mode.FULL).logits
    err_theirs, err_ours = float((theirs - ref).abs().max()), float((ours - ref).abs().max())
    assert ours.dtype == torch.float32 and lm16.model.dtype == torch.bfloat16
    assert err_ours <= 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)


def _kl(ref: torch.Tensor, out: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize("name", CHUNK_KV_NAMES)
def test_blend_tracks_full_closer_than_reuse(tmp_path_factory, name):
    """Windows widened to 64 so the question sees the chunks (with the tests' window of 8 it
    sees only itself, and reuse is exact). The deviation selector: on random weights the
    question's attention means nothing, so the query selector is no better than chance
    there; the KV deviation CacheBlend scores is the model-agnostic signal."""
    wide = {"sliding_window": 64} if "sliding_window" in FAMILY_CONFIGS[name][1] else {}
    lm = _lm(tmp_path_factory, name, **wide)
    engine = Engine(lm)
    fmt = engine.prompt
    prefix, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS]
    chunks = [engine.prefill(prefix, ids) for ids in chunk_ids]
    reuse = blend = 0.0
    for q in QUESTIONS:
        q_ids = fmt.question_ids(q)
        full = engine.run(Prompt(q_ids, prefix, chunk_ids, None), Mode.FULL).logits
        reuse += _kl(full, engine.run(Prompt(q_ids, prefix, chunk_ids, chunks), Mode.REUSE).logits)
        opts = BlendOptions(recompute_ratio=0.15, selector="deviation")
        blend += _kl(full, engine.run(Prompt(q_ids, prefix, chunk_ids, chunks), Mode.BLEND, opts).logits)
    assert blend < reuse, (blend, reuse)


def test_moe_experts_run_only_the_recomputed_tokens(tmp_path_factory):
    lm = _lm(tmp_path_factory, "qwen3_moe")
    engine = Engine(lm)
    fmt = engine.prompt
    prefix, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS]
    chunks = [engine.prefill(prefix, ids) for ids in chunk_ids]
    q_ids = fmt.question_ids(QUESTIONS[0])
    seen: list[int] = []
    moe = lm.model.model.layers[0].mlp  # a sparse block (layer 1 is the dense one in this config)
    assert hasattr(moe, "experts")
    hook = moe.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    try:
        res = engine.run(Prompt(q_ids, prefix, chunk_ids, chunks), Mode.BLEND, BlendOptions(recompute_ratio=0.15))
    finally:
        hook.remove()
    n_chunk = sum(map(len, chunk_ids))
    picked = round(0.15 * n_chunk)
    assert res.recomputed.numel() == picked
    # the query selector's scoring pass runs the question; the blend pass the picked tokens and
    # the question: the other 85% of the chunk tokens (and the prefix) never reach the experts
    assert seen == [len(q_ids), picked + len(q_ids)]


def test_a_wrong_adapter_fails_the_gate(tmp_path_factory):
    """Qwen3 served as if it were Llama (no q/k norm): the gate must say so, with the numbers."""
    lm = _lm(tmp_path_factory, "qwen3")
    wrong = dataclasses.replace(lm, adapter=Adapter(lm.model, FAMILIES["llama"]))
    checks = {c.name: c for c in check_model(wrong, quick=True)}
    assert not checks["logits vs transformers"].passed
    assert checks["logits vs transformers"].value > 1e-2
    assert "max abs diff" in checks["logits vs transformers"].detail


def test_windowed_layers_attend_within_their_window(tmp_path_factory):
    """Gemma 3's local layers see 8 keys, its global layers all: the plan differs per layer."""
    lm = _lm(tmp_path_factory, "gemma3_text")
    windows = [a.window for a in lm.adapter.attention]
    assert windows == [8, None, 8, None]
    kinds = lm.adapter.rotary(torch.arange(4), torch.empty(0)).kind
    assert kinds[0] == kinds[2] != kinds[1] == kinds[3]  # local and global rotary tables
    # a windowed layer's question sees only its last 8 keys: the chunks are scored on global layers
    assert lm.adapter.scoring_layers([2]) == [1]
    assert lm.adapter.scoring_layers(range(4)) == [1, 3]


@pytest.mark.parametrize("name", CHUNK_KV_NAMES)
def test_every_mode_serves_every_family(tmp_path_factory, name):
    lm = _lm(tmp_path_factory, name)
    engine = Engine(lm)
    fmt = engine.prompt
    prefix, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS]
    chunks = [engine.prefill(prefix, ids) for ids in chunk_ids]
    q_ids = fmt.question_ids(QUESTIONS[0])
    for mode in Mode:
        res = engine.run(Prompt(q_ids, prefix, chunk_ids, chunks), mode, BlendOptions(recompute_ratio=0.15))
        assert torch.isfinite(res.logits).all(), mode
        stream = engine.decode(res)
        assert isinstance(next(iter(stream), ""), str)
        if mode is Mode.FOCUS:
            assert res.used_chunks


def _steps(engine: Engine, prompt: Prompt, mode: Mode, options: BlendOptions | None):
    """Run a pass step by step: its result and the tokens of each of its layer steps."""
    steps, tokens = engine.run_steps(prompt, mode, options), []
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            return done.value, tokens
        if isinstance(item, LayerWork):
            tokens.append(item.rows)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_equals_whole_layers(tmp_path_factory, name):
    """A pass cut into steps of at most 7 prompt tokens (`Engine.step_tokens`; the prompts here
    are 60-90 tokens) gives the logits and the cache of whole-layer steps, in every mode: the
    pieces' attention plans (windows, attention chunks, scattered recompute) and a hybrid's
    recurrent layers (run whole) change no sum. Deviation blend at ratio 1.0: at a lower ratio
    its cut falls among tokens whose KV is exact (deviation ~1e-11), picked by float noise."""
    lm = _lm(tmp_path_factory, name)
    whole, cut = Engine(lm, step_tokens=0), Engine(lm, step_tokens=7)
    fmt = whole.prompt
    prefix, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS]
    q_ids = fmt.question_ids(QUESTIONS[0])
    runs: list[tuple[Mode, bool, BlendOptions | None]] = [(Mode.FULL, False, None)]
    if name not in HYBRIDS:
        runs += [(Mode.PREFIX, False, None), (Mode.REUSE, True, None),
                 (Mode.BLEND, True, BlendOptions(recompute_ratio=0.5)),
                 (Mode.BLEND, True, BlendOptions(recompute_ratio=1.0, selector="deviation")),
                 (Mode.FOCUS, True, None)]
        chunks = [whole.prefill(prefix, ids) for ids in chunk_ids]
    for mode, with_kv, opts in runs:
        prompt = Prompt(q_ids, prefix, chunk_ids, chunks if with_kv else None)
        (a, a_steps), (b, b_steps) = _steps(whole, prompt, mode, opts), _steps(cut, prompt, mode, opts)
        assert max(a_steps) > 7 and len(b_steps) > len(a_steps), (mode, a_steps, b_steps)  # the pieces ran as steps
        # no step past 7 rows, but a hybrid's recurrent layers (whole: their state carries)
        assert len([t for t in b_steps if t > 7]) == len(lm.adapter.recurrent_layers), (mode, b_steps)
        assert sum(b_steps) == sum(a_steps), mode  # the same rows, layer by layer
        assert torch.equal(a.recomputed, b.recomputed), mode
        scale = max(1.0, float(a.logits.abs().max()))
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4 * scale, rtol=0, msg=lambda m, mode=mode: f"{mode}: {m}")
        n = a.cache.length
        torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.cache.v[:, :, :n], a.cache.v[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_passes_side_by_side_equal_each_alone(tmp_path_factory, name, monkeypatch):
    """Passes of every mode run side by side, each layer they stand at together run as one forward
    (`drain_together`, the scheduler's `prompt_batch_rows`), give each pass's logits and cache
    alone: a pass's attention reads its own cache only, whatever rows sit beside it (windows,
    attention chunks, scattered recompute; a hybrid's recurrent layers run pass by pass)."""
    import ragkv.engine.forward as forward

    lm = _lm(tmp_path_factory, name)
    engine = Engine(lm)
    fmt = engine.prompt
    prefix, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS]
    runs: list[tuple[Mode, BlendOptions | None, int]] = [(Mode.FULL, None, 0), (Mode.FULL, None, 1)]
    chunks = None
    if name not in HYBRIDS:
        chunks = [engine.prefill(prefix, ids) for ids in chunk_ids]
        runs += [(Mode.REUSE, None, 0), (Mode.REUSE, None, 2), (Mode.BLEND, BlendOptions(recompute_ratio=0.5), 1),
                 (Mode.BLEND, BlendOptions(recompute_ratio=0.3), 2), (Mode.FOCUS, None, 0)]

    def passes():
        return [engine.run_steps(Prompt(fmt.question_ids(QUESTIONS[q]), prefix, chunk_ids,
                                        None if mode is Mode.FULL else chunks), mode, opts)
                for mode, opts, q in runs]

    alone = [drain(p) for p in passes()]
    shared: list[int] = []
    run_layers = forward.run_layers

    def spy(works):
        shared.append(len(works))
        run_layers(works)

    monkeypatch.setattr(forward, "run_layers", spy)
    together = drain_together(passes())
    assert max(shared) == len(runs)  # every pass at once, their scoring layers' weights summed pass by pass
    assert sum(n > 1 for n in shared) >= lm.num_layers - len(lm.adapter.recurrent_layers)
    for (mode, _, _), a, b in zip(runs, alone, together):
        assert torch.equal(a.recomputed, b.recomputed), mode
        scale = max(1.0, float(a.logits.abs().max()))
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4 * scale, rtol=0, msg=lambda m, mode=mode: f"{mode}: {m}")
        n = a.cache.length
        torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.cache.v[:, :, :n], a.cache.v[:, :, :n], atol=1e-4, rtol=1e-4)


_SMALL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("arch, text, extra", [
    ("Gemma3", "gemma3_text", {"vision_config": {**_SMALL_VISION, "image_size": 32, "patch_size": 16},
                               "mm_tokens_per_image": 4}),
    ("Gemma4", "gemma4_text", {"vision_config": _SMALL_VISION, "audio_config": None}),
    ("Qwen3_5", "qwen3_5_text", {"vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                   "num_heads": 2, "out_hidden_size": 64}}),
])
def test_a_multimodal_checkpoint_is_served_as_its_language_model(tmp_path, arch, text, extra):
    """The checkpoints people download (Gemma 3 from 4B up, Gemma 4, Qwen3.5) are vision(-audio)
    models: ragkv loads their language model's weights out of them (Gemma 3's in the published
    layout, language_model.model.*), the towers left on disk, and serves it through the gate."""
    import transformers

    text_dir = tiny_model_dir(tmp_path / "text", text, family=True, tie_word_embeddings=arch.startswith("Gemma"))
    config = getattr(transformers, f"{arch}Config")(
        text_config=transformers.AutoConfig.from_pretrained(text_dir).to_dict(), **extra)
    torch.manual_seed(0)
    vl = getattr(transformers, f"{arch}ForConditionalGeneration")(config).eval()
    vl.save_pretrained(tmp_path / "vl")
    transformers.AutoTokenizer.from_pretrained(text_dir).save_pretrained(tmp_path / "vl")

    lm = load_model(str(tmp_path / "vl"), device="cpu", dtype="float32")
    assert lm.adapter.family.model_type == text
    theirs, ours = dict(vl.model.language_model.named_parameters()), dict(lm.model.model.named_parameters())
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert torch.equal(vl.lm_head.weight, lm.model.lm_head.weight)
    assert all(c.passed for c in check_model(lm, quick=True))


def test_chunked_attention_layers_see_only_their_own_chunk(tmp_path_factory):
    """Llama 4: RoPE layers attend within chunks of attention_chunk_size (8 here), the no-RoPE
    layers globally with position-scaled queries; chunks are scored on the global layers."""
    from ragkv.engine.forward import Heads, plan_attention

    lm = _lm(tmp_path_factory, "llama4_text")
    assert [a.locality for a in lm.adapter.attention] == [(None, 8), (None, None), (None, 8), (None, None)]
    assert lm.adapter.scoring_layers(range(4)) == [1, 3]
    rope = lm.adapter.rotary(torch.arange(20), torch.empty(0))
    assert [k < 0 for k in rope.kind] == [False, True, False, True]
    assert rope.q_scale is not None and rope.q_scale[0] == 1.0 and rope.q_scale[19] > 1.0  # floor_scale 4
    q_pos = torch.arange(20)
    plan = plan_attention(q_pos, 20, Heads(4, 2, 16, 0.25, None, attention_chunk=8))
    mask = torch.cat([a.mask for a in plan])
    i, j = q_pos[:, None], q_pos[None, :]
    assert torch.equal(mask, (j <= i) & (j // 8 == i // 8))
    # selective recompute: scattered queries over a longer cache keep to their own chunk
    sel = torch.tensor([3, 9, 17, 18])
    (a,) = plan_attention(sel, 19, Heads(4, 2, 16, 0.25, None, attention_chunk=8))
    assert a.mask[1].nonzero().flatten().tolist() == [8, 9]
    assert a.mask[2].nonzero().flatten().tolist() == [16, 17]


@pytest.mark.parametrize("name", ["hunyuan_v1_dense", "llama4_text", "deepseek_v3", "deepseek_v2"])
def test_attention_equals_the_models_own_module_away_from_position_zero(tmp_path_factory, name):
    """The layer-0 attention of the model's own module, at positions 37.., against ours: q/k
    norms after RoPE (Hunyuan: key stored without the norm's weight, the weights on the query;
    Llama 4: L2 norm before RoPE) and latent attention with absorbed projections (DeepSeek)."""
    lm = _lm(tmp_path_factory, name)
    ad, attn = lm.adapter, lm.adapter.layers[0].self_attn
    torch.manual_seed(0)
    x = torch.randn(12, lm.model.config.hidden_size)  # [S, hidden]
    pos = torch.arange(37, 49)
    with torch.no_grad():
        pe = ad.base.rotary_emb(x[None], pos[None])
        want = attn(hidden_states=x[None], position_embeddings=pe, attention_mask=None)[0][0]  # [S, hidden]
        q, k, v = ad.qkv(0, x)
        rope = ad.rotary(pos, x)
        q, k = rope.scale_query(rope.apply(q, 0), 0), rope.apply(k, 0)
        if ad.folds_key_norm:
            q = ad.fold_key_norm(0, q)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=ad.attention[0].scaling,
            enable_gqa=ad.num_heads != ad.num_kv_heads)[0]  # [H, S, D]
        got = ad.attn_output(0, out.transpose(0, 1).reshape(12, ad.num_heads * ad.head_dim))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_latent_attention_stores_the_latent_per_token(tmp_path_factory):
    """DeepSeek: a chunk's stored KV is one head of [RoPE key; c_kv] (8 + 16 dims here), not
    the per-head expanded K and V (4 heads x (20 + 10)), and its file holds that latent once."""
    lm = _lm(tmp_path_factory, "deepseek_v3")
    cfg = lm.model.config
    assert (lm.num_kv_heads, lm.head_dim) == (1, cfg.qk_rope_head_dim + cfg.kv_lora_rank)
    engine = Engine(lm)
    ids = engine.prompt.chunk_ids(TEXTS[0])
    kv = engine.prefill(engine.prompt.prefix_ids(), ids)
    assert tuple(kv.k.shape) == (cfg.num_hidden_layers, 1, len(ids), 24) == tuple(kv.v.shape)
    expanded = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert lm.head_dim * 5 == expanded  # 24 numbers per layer and token, not 120
    # the store holds the latent once (V is the same latent), and serves it back as both
    from ragkv.kvstore import ChunkKey, KVEntry, hash_prefix
    from ragkv.kvstore.fileformat import decode, encode

    prefix = engine.prompt.prefix_ids()
    key = ChunkKey.build(lm.fingerprint, lm.tokenizer_fingerprint, prefix, ids)
    entry = KVEntry.of(kv, key, lm.fingerprint, lm.tokenizer_fingerprint, hash_prefix(prefix))
    data = encode(entry)
    assert len(data) < kv.k.nbytes + kv.v.nbytes * 0.1
    back = decode(bytearray(data), expected_key=key, model_fp=lm.fingerprint, tokenizer_fp=lm.tokenizer_fingerprint)
    assert back.v is back.k and torch.equal(back.k, kv.v)


@pytest.mark.parametrize("name", HYBRID_NAMES)
def test_hybrids_serve_full_and_refuse_chunk_kv_modes_by_name(tmp_path_factory, name):
    """A hybrid's recurrent layers hold a state no stored chunk can stand in for: FULL serves it
    (and decodes, state carried), every chunk-KV mode and chunk prefill are refused saying why,
    and its KV tree holds recurrent states too (tests/engine/test_tree.py)."""
    from ragkv.errors import UnsupportedModelError

    lm = _lm(tmp_path_factory, name)
    engine = Engine(lm, tree=TreeConfig(1 << 20))
    assert engine.modes() == {Mode.FULL} and engine.conversations.enabled and engine.conversations.tree.recurrent
    fmt = engine.prompt
    prefix, chunk_ids, q_ids = fmt.prefix_ids(), [fmt.chunk_ids(t) for t in TEXTS[:2]], fmt.question_ids(QUESTIONS[0])
    res = engine.run(Prompt(q_ids, prefix, chunk_ids, None), Mode.FULL)
    assert torch.isfinite(res.logits).all() and res.cache.recurrent is not None
    attending = lm.num_layers - len(lm.adapter.recurrent_layers)  # the cache holds the attention layers only
    assert res.cache.k.shape[0] == lm.kv_layers == attending == 2
    assert engine.kv_bytes_per_token == 2 * attending * lm.num_kv_heads * lm.head_dim * 4
    for mode in set(Mode) - {Mode.FULL}:
        with pytest.raises(UnsupportedModelError, match=f"mode '{mode.value}' cannot serve .* recurrent"):
            engine.run(Prompt(q_ids, prefix, chunk_ids, None), mode)
    with pytest.raises(UnsupportedModelError, match="use mode 'full'"):
        engine.prefill(prefix, chunk_ids[0])

