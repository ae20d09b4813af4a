"""Attention plans: the CPU split path (open keys + masked span, merged by LSE) against one
masked SDPA call, on SmolLM2's geometry (9 query heads over 3 KV heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragkv.engine.forward import Heads, attention, plan_attention

HEADS = Heads(num_heads=9, num_kv_heads=3, head_dim=64, scaling=64 ** -0.5, sliding_window=None)


def _reference(q, k, v, q_pos):  # one masked call over every key: [H, S, D]
    mask = torch.arange(k.shape[1], device=q_pos.device)[None, :] <= q_pos[:, None]  # [S, N]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=HEADS.scaling,
                                          enable_gqa=True)[0]


def _run(plans, q, k, v):
    return torch.cat([attention(q[:, a.rows], k, v, a, HEADS) for a in plans], 1)


@pytest.mark.parametrize("n_keys,n_queries", [(2048, 300), (4136, 614)])
def test_split_plan_matches_one_masked_call(n_keys, n_queries):
    g = torch.Generator().manual_seed(n_keys)
    q_pos = torch.sort(torch.randperm(n_keys - 40, generator=g)[:n_queries] + 40).values  # scattered, sorted
    q = torch.randn(9, n_queries, 64, generator=g)
    k, v = torch.randn(3, n_keys, 64, generator=g), torch.randn(3, n_keys, 64, generator=g)
    k[:, 0] *= 8  # a sink-like key that takes most of the weight, as in real models
    plans = plan_attention(q_pos, n_keys, HEADS)
    split = [a for a in plans if a.tail_bias is not None]
    assert len(plans) > 1 and split == plans[1:]  # the first group starts too early to pay a second call
    for a in split:  # the open keys are visible to every query of the group; the span is masked
        assert a.mask[:, : a.open_keys].all() and a.tail_bias.shape == (3 * a.mask.shape[0], a.n_keys - a.open_keys)
        assert (a.tail_bias == 0).any(1).all()  # no row of the span is fully masked
    out = _run(plans, q, k, v)
    torch.testing.assert_close(out, _reference(q, k, v, q_pos), atol=2e-6, rtol=1e-5)


def test_question_and_decode_plans_do_not_split():
    """A few queries gain nothing from the split, and keep the exact sums of full prefill."""
    assert all(a.tail_bias is None for a in plan_attention(torch.arange(3000, 3020), 3020, HEADS))
    assert all(a.tail_bias is None for a in plan_attention(torch.tensor([3019]), 3020, HEADS))


def test_short_prefix_groups_keep_one_masked_call():
    q_pos = torch.arange(0, 400, 2)  # the first group's open keys are too few to pay a second call
    plans = plan_attention(q_pos, 400, HEADS)
    assert plans[0].tail_bias is None


def test_decode_attention_folds_heads_and_matches_gqa_sdpa():
    g = torch.Generator().manual_seed(7)
    n = 1500
    k, v = torch.randn(3, n + 64, 64, generator=g), torch.randn(3, n + 64, 64, generator=g)  # capacity > n
    q = torch.randn(9, 1, 64, generator=g)  # [H, 1, D]
    (plan,) = plan_attention(torch.tensor([n - 1]), n, HEADS)
    assert plan.mask is None and not plan.causal  # the last query sees every key: no mask
    ref = F.scaled_dot_product_attention(q[None], k[None, :, :n], v[None, :, :n], scale=HEADS.scaling,
                                         enable_gqa=True)[0]
    torch.testing.assert_close(attention(q, k, v, plan, HEADS), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dense", [True, False])
def test_window_groups_read_only_their_window_and_match_one_masked_call(dense):
    """A sliding-window layer (window 512): each group of queries reads keys from its first
    query's window on, not every key before it; the output is one masked call's over all keys
    (full prefill's dense queries, and selective recompute's scattered ones)."""
    heads = Heads(num_heads=9, num_kv_heads=3, head_dim=64, scaling=64 ** -0.5, sliding_window=512)
    n_keys = 2600
    g = torch.Generator().manual_seed(3)
    q_pos = torch.arange(n_keys) if dense else torch.sort(torch.randperm(n_keys, generator=g)[:390]).values
    q = torch.randn(9, q_pos.shape[0], 64, generator=g)
    k, v = torch.randn(3, n_keys, 64, generator=g), torch.randn(3, n_keys, 64, generator=g)
    plans = plan_attention(q_pos, n_keys, heads)
    assert len(plans) > 1
    for a in plans:
        first = int(q_pos[a.rows.start])
        assert a.first_key == max(0, first - 511)
        assert a.mask.shape == (a.rows.stop - a.rows.start, a.n_keys - a.first_key)
        assert a.mask.any(1).all()  # every query sees at least itself
    assert sum(a.n_keys - a.first_key for a in plans) < 0.5 * len(plans) * n_keys  # the window, not every key
    i, j = q_pos[:, None], torch.arange(n_keys)[None, :]
    mask = (j <= i) & (j > i - 512)  # [S, N]
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=heads.scaling,
                                         enable_gqa=True)[0]
    out = torch.cat([attention(q[:, a.rows], k, v, a, heads) for a in plans], 1)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n_queries", [2, 37, 700])
def test_the_last_keys_queries_attend_causally_from_the_bottom_right(n_queries):
    """A GPU's plan for queries that are the last keys (a chunked prefill's piece, the question
    after its chunks): one causal call aligned at the bottom right, no mask. Its output and its
    weights (the scoring pass's, soft-capped layers') are one masked call's."""
    from ragkv.engine.family import LayerAttention
    from ragkv.engine.forward import Attend, attention_weights

    n_keys = 1200
    g = torch.Generator().manual_seed(n_queries)
    q_pos = torch.arange(n_keys - n_queries, n_keys)
    q = torch.randn(9, n_queries, 64, generator=g)
    k, v = torch.randn(3, n_keys + 16, 64, generator=g), torch.randn(3, n_keys + 16, 64, generator=g)  # capacity > n
    plan = Attend(slice(0, n_queries), n_keys, True, None)
    ref = _reference(q, k[:, :n_keys], v[:, :n_keys], q_pos)
    torch.testing.assert_close(attention(q, k, v, plan, HEADS), ref, atol=2e-6, rtol=1e-5)
    la = LayerAttention(scaling=HEADS.scaling, window=None)
    w = attention_weights(q, k, plan, HEADS, la)  # [H, S, N]
    masked = Attend(slice(0, n_queries), n_keys, False, torch.arange(n_keys)[None, :] <= q_pos[:, None])
    torch.testing.assert_close(w, attention_weights(q, k, masked, HEADS, la), atol=1e-7, rtol=1e-6)
    assert float(w[:, 0, n_keys - n_queries + 1:].abs().max()) == 0.0  # the first query sees no later key


def test_the_cpu_keeps_its_split_path_for_the_last_keys():
    plans = plan_attention(torch.arange(2048, 4096), 4096, HEADS)
    assert len(plans) > 1 and not any(a.causal for a in plans) and plans[-1].tail_bias is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_plans_the_last_keys_as_one_causal_call(dtype):
    """On a GPU the last keys' queries run one causal call from the bottom right (flash), with
    one masked call's output."""
    n_keys, s = 3000, 700
    q_pos = torch.arange(n_keys - s, n_keys, device="cuda")
    (plan,) = plan_attention(q_pos, n_keys, HEADS)
    assert plan.causal and plan.mask is None
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(9, s, 64, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(3, n_keys, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    ref = _reference(q.double(), k.double(), v.double(), q_pos)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attention(q, k, v, plan, HEADS).double(), ref, atol=tol, rtol=0)
