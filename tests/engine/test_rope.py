"""RoPE: attention depends only on relative positions, so shifting a whole sequence by
Δ leaves attention outputs unchanged; shifting one side does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragkv.engine import load_model
from ragkv.engine.rope import apply_rope


@pytest.fixture(scope="module")
def lm(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def rotary_tables(lm, pos, like):
    """The model's one rotary table (a Llama has one kind for every layer) at pos: cos, sin [S, D]."""
    rope = lm.adapter.rotary(pos, like)
    return rope.cos[0], rope.sin[0]


def _attend(lm, q, k, v, start):
    pos = torch.arange(start, start + q.shape[1])
    cos, sin = rotary_tables(lm, pos, q)
    return F.scaled_dot_product_attention(apply_rope(q, cos, sin)[None], apply_rope(k, cos, sin)[None],
                                          v[None], is_causal=True)[0]


@pytest.mark.parametrize("delta", [1, 37, 1000])
def test_shifting_the_whole_sequence_keeps_attention(lm, delta):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, lm.head_dim, generator=g) for _ in range(3))
    base = _attend(lm, q, k, v, 0)
    shifted = _attend(lm, q, k, v, delta)
    assert (base - shifted).abs().max() < 1e-4


def test_shifting_keys_alone_changes_attention(lm):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, lm.head_dim, generator=g) for _ in range(3))
    pos = torch.arange(24)
    cq, sq = rotary_tables(lm, pos, q)
    ck, sk = rotary_tables(lm, pos + 5, q)
    out = F.scaled_dot_product_attention(apply_rope(q, cq, sq)[None], apply_rope(k, ck, sk)[None], v[None],
                                         is_causal=True)[0]
    assert (out - _attend(lm, q, k, v, 0)).abs().max() > 1e-3


def test_rope_matches_transformers(lm):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 10, lm.head_dim, generator=g), torch.randn(1, 2, 10, lm.head_dim, generator=g)
    cos, sin = rotary_tables(lm, torch.arange(3, 13), q)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert torch.allclose(apply_rope(q, cos, sin), ref_q, atol=1e-6)
    assert torch.allclose(apply_rope(k, cos, sin), ref_k, atol=1e-6)
