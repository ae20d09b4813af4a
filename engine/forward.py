"""One decoder layer over a subset of tokens, reading and writing a shared KV cache.

This is the hot path of every mode: full prefill (all tokens), chunk prefill (the
chunk after a cached prefix), selective recompute (a few tokens against the whole
blended cache) and decode (one token). It uses the model's own modules (norms,
projections, MLP) so numerics match transformers; only attention is ours, because
its mask must come from positions: SDPA's `is_causal=True` aligns top-left when
there are fewer queries than keys, which is wrong for recomputing selected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kv import KVCache
from engine.rope import apply_rope


@dataclass(frozen=True, slots=True)
class Heads:
    """Attention geometry of a model."""

    num_heads: int  # query heads
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    scaling: float  # softmax scale, usually D ** -0.5
    sliding_window: int | None  # None = every earlier key is visible


@dataclass(frozen=True, slots=True)
class Attend:
    """Which cached keys the current queries see."""

    n_keys: int  # keys [0, n_keys) of the cache take part
    causal: bool  # queries are exactly keys [0, n_keys): use SDPA's causal kernel
    mask: torch.Tensor | None  # [S, n_keys] bool, True = may attend; None with causal or all-visible


def plan_attention(q_pos: torch.Tensor, n_keys: int, heads: Heads) -> Attend:
    """The attention pattern for queries at positions q_pos over cache keys [0, n_keys).

    Key j sits at position j (prompt positions are contiguous), so query i may see key j
    iff j <= q_pos[i] (and j > q_pos[i] - window under a sliding window).
    """
    s = q_pos.shape[0]
    window = heads.sliding_window
    windowed = window is not None and n_keys > window
    if not windowed and s == n_keys and _is_arange(q_pos):
        return Attend(n_keys, True, None)
    if not windowed and s == 1 and int(q_pos[0]) == n_keys - 1:
        return Attend(n_keys, False, None)  # one query at the end sees everything
    k_pos = torch.arange(n_keys, device=q_pos.device)  # [n_keys]
    mask = k_pos[None, :] <= q_pos[:, None]  # [S, n_keys]
    if windowed:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return Attend(n_keys, False, mask)


def _is_arange(pos: torch.Tensor) -> bool:
    n = pos.shape[0]
    return n > 0 and int(pos[0]) == 0 and int(pos[-1]) == n - 1


def project_kv(layer: Any, h: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before RoPE) and V of hidden states h: [S, hidden] -> each [Hkv, S, D]."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    s = h.shape[0]
    k = attn.k_proj(x).view(s, heads.num_kv_heads, heads.head_dim).transpose(0, 1)  # [Hkv, S, D]
    v = attn.v_proj(x).view(s, heads.num_kv_heads, heads.head_dim).transpose(0, 1)  # [Hkv, S, D]
    return k, v


def layer_forward(
    layer: Any,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    layer_idx: int,
    slots: slice | torch.Tensor,
    attend: Attend,
    heads: Heads,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run one decoder layer for the active tokens.

    Args:
        h: [S, hidden] hidden states of the active tokens.
        cos, sin: [S, D] rotary tables at the active tokens' positions.
        cache: the whole prompt's cache; the active tokens' K/V are written at `slots`.
        slots: where the active tokens live in the cache (a slice, or [S] int64 indices).

    Returns:
        h_out [S, hidden], k before RoPE [Hkv, S, D], v [Hkv, S, D].
    """
    attn = layer.self_attn
    s = h.shape[0]
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(s, heads.num_heads, heads.head_dim).transpose(0, 1)  # [H, S, D]
    k = attn.k_proj(x).view(s, heads.num_kv_heads, heads.head_dim).transpose(0, 1)  # [Hkv, S, D]
    v = attn.v_proj(x).view(s, heads.num_kv_heads, heads.head_dim).transpose(0, 1)  # [Hkv, S, D]
    q = apply_rope(q, cos, sin)
    k_cache = cache.k[layer_idx]  # [Hkv, cap, D]
    v_cache = cache.v[layer_idx]
    k_cache[:, slots] = apply_rope(k, cos, sin)
    v_cache[:, slots] = v
    out = F.scaled_dot_product_attention(
        q[None],  # [1, H, S, D]
        k_cache[None, :, : attend.n_keys],  # [1, Hkv, n_keys, D]
        v_cache[None, :, : attend.n_keys],
        attn_mask=attend.mask,
        is_causal=attend.causal,
        scale=heads.scaling,
        enable_gqa=heads.num_heads != heads.num_kv_heads,
    )  # [1, H, S, D]
    out = out[0].transpose(0, 1).reshape(s, heads.num_heads * heads.head_dim)  # [S, H*D]
    h = h + attn.o_proj(out)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k, v
