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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ragkv.engine.kv import KVCache
from ragkv.engine.rope import apply_rope

if TYPE_CHECKING:
    from ragkv.engine.loading import LoadedModel


@dataclass(frozen=True, slots=True)
class Heads:
    """Attention geometry of a model."""

    num_heads: int  # query heads
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    scaling: float  # softmax scale, usually D ** -0.5
    sliding_window: int | None  # None = every earlier key is visible


def heads_of(lm: LoadedModel) -> Heads:
    """The attention geometry of a loaded model."""
    attn = lm.model.model.layers[0].self_attn
    return Heads(lm.num_heads, lm.num_kv_heads, lm.head_dim, float(attn.scaling), lm.sliding_window)


@dataclass(frozen=True, slots=True)
class Attend:
    """Which cached keys one group of queries sees."""

    rows: slice  # the queries of this group (rows of h)
    n_keys: int  # keys [0, n_keys) of the cache take part
    causal: bool  # queries are exactly keys [0, n_keys): use SDPA's causal kernel
    mask: torch.Tensor | None  # [S_g, n_keys] bool, True = may attend; None with causal or all-visible
    # CPU split path (`_split_attention`): keys [0, open_keys) are visible to every query of
    # the group; tail_bias is the additive mask of the rest, one row per folded query head
    open_keys: int = 0
    tail_bias: torch.Tensor | None = None  # [g*S_g, n_keys - open_keys] float32, 0 or -inf


_GROUP_MIN_QUERIES = 64  # scattered queries are split into groups of at least this many


def plan_attention(q_pos: torch.Tensor, n_keys: int, heads: Heads) -> list[Attend]:
    """The attention pattern for sorted queries at positions q_pos over cache keys [0, n_keys).

    Key j sits at position j (prompt positions are contiguous), so query i may see key j
    iff j <= q_pos[i] (and j > q_pos[i] - window under a sliding window). Scattered
    queries (selective recompute) are split into groups, each reading keys only up to
    its last query: about half the work of one [S, n_keys] mask.
    """
    s = q_pos.shape[0]
    window = heads.sliding_window
    windowed = window is not None and n_keys > window
    if not windowed and s == n_keys and _is_arange(q_pos):
        return [Attend(slice(0, s), n_keys, True, None)]
    if not windowed and s == 1 and int(q_pos[0]) == n_keys - 1:
        return [Attend(slice(0, 1), n_keys, False, None)]  # one query at the end sees everything
    n_groups = 1 if windowed else max(1, min(8, s // _GROUP_MIN_QUERIES))
    bounds = [round(g * s / n_groups) for g in range(n_groups + 1)]
    ends = (q_pos[[b - 1 for b in bounds[1:]]] + 1).tolist()  # keys each group needs
    plans = []
    for g in range(n_groups):
        rows = slice(bounds[g], bounds[g + 1])
        keys = n_keys if windowed else int(ends[g])
        k_pos = torch.arange(keys, device=q_pos.device)  # [keys]
        mask = k_pos[None, :] <= q_pos[rows, None]  # [S_g, keys]
        if windowed:
            mask &= k_pos[None, :] > q_pos[rows, None] - window
        plans.append(_with_split(Attend(rows, keys, False, mask), q_pos, heads) if not windowed
                     else Attend(rows, keys, False, mask))
    return plans


def _with_split(a: Attend, q_pos: torch.Tensor, heads: Heads) -> Attend:
    """`a` with the CPU split path's data, built once per plan (a plan serves every layer)."""
    # keys before the group's first query are open to all of its queries; the span starts at
    # that query's own key, so every row of the span sees at least one key (a fully masked
    # row would come back from the kernel with LSE 0, not -inf, and skew the merge)
    open_keys = int(q_pos[a.rows.start])
    s = a.rows.stop - a.rows.start
    if (q_pos.device.type != "cpu" or _CPU_FLASH is None or open_keys < _SPLIT_MIN_OPEN_KEYS
            or s < _GROUP_MIN_QUERIES):  # a few queries (the question, decode): no gain worth other sums
        return a
    g = heads.num_heads // heads.num_kv_heads
    bias = torch.zeros(a.mask.shape[0], a.n_keys - open_keys).masked_fill_(~a.mask[:, open_keys:], float("-inf"))
    return Attend(a.rows, a.n_keys, False, a.mask, open_keys, bias.repeat(g, 1))  # [g*S_g, span]


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
    attend: list[Attend],
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
    out = torch.cat([attention(q[:, a.rows], k_cache, v_cache, a, heads) for a in attend], 1) \
        if len(attend) > 1 else attention(q, k_cache, v_cache, attend[0], heads)  # [H, S, D]
    out = out.transpose(0, 1).reshape(s, heads.num_heads * heads.head_dim)  # [S, H*D]
    h = h + attn.o_proj(out)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k, v


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: Attend, heads: Heads,
              ) -> torch.Tensor:
    """SDPA of q: [H, S_g, D] over cache keys [0, a.n_keys) -> [H, S_g, D]."""
    if a.tail_bias is not None:  # built only on CPU (_with_split)
        return _split_attention(q, k_cache, v_cache, a, heads)
    if a.mask is None and not a.causal and heads.num_heads != heads.num_kv_heads and q.device.type == "cpu":
        # decode (queries that see every key): folded heads instead of SDPA's GQA path,
        # which repeats the whole K and V per call on CPU
        out = F.scaled_dot_product_attention(
            _fold_heads(q, heads)[None], k_cache[None, :, : a.n_keys], v_cache[None, :, : a.n_keys],
            scale=heads.scaling,
        )[0]  # [Hkv, g*S_g, D]
        return out.reshape(q.shape)
    return F.scaled_dot_product_attention(
        q[None],  # [1, H, S_g, D]
        k_cache[None, :, : a.n_keys],  # [1, Hkv, n_keys, D]
        v_cache[None, :, : a.n_keys],
        attn_mask=a.mask,
        is_causal=a.causal,
        scale=heads.scaling,
        enable_gqa=heads.num_heads != heads.num_kv_heads,
    )[0]


# CPU: a masked group is split where its mask starts to matter. Keys every query sees run
# through the flash kernel without a mask (its fast path); only the group's own span is
# masked; the two halves merge by their log-sum-exp. 1.2x faster than one masked call
# per group in bench/attention_bench.py; in blend@0.15 on 8x512 tokens the attention's
# share fell from 1.82 s to 1.24 s (no bool-mask conversion, no GQA repeat of K/V). The
# private op returns the LSE that the public SDPA does not.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SPLIT_MIN_OPEN_KEYS = 256  # below this the second kernel call costs more than it saves


def _split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: Attend,
                     heads: Heads) -> torch.Tensor:
    """`attention` for a masked group on CPU, as [open keys] + [masked span], merged by LSE."""
    lo = a.open_keys
    qf = _fold_heads(q, heads)[None]  # [1, Hkv, g*S_g, D]
    k, v = k_cache[None, :, : a.n_keys], v_cache[None, :, : a.n_keys]  # [1, Hkv, n_keys, D]
    o1, lse1 = _CPU_FLASH(qf, k[:, :, :lo], v[:, :, :lo], scale=heads.scaling)  # [1, Hkv, g*S_g, D], [1, Hkv, g*S_g]
    o2, lse2 = _CPU_FLASH(qf, k[:, :, lo:], v[:, :, lo:], attn_mask=a.tail_bias.to(q.dtype), scale=heads.scaling)
    lse = torch.logaddexp(lse1, lse2)  # [1, Hkv, g*S_g]
    out = o1.mul_((lse1 - lse).exp_()[..., None]).addcmul_(o2, (lse2 - lse).exp_()[..., None])  # [1, Hkv, g*S_g, D]
    return out[0].reshape(q.shape)


def _fold_heads(q: torch.Tensor, heads: Heads) -> torch.Tensor:
    """[H, S, D] -> [Hkv, g*S, D]: each KV head's g query heads as rows (GQA without
    repeating K and V); a mask over S rows repeats g times to match."""
    h, s, d = q.shape
    return q.reshape(heads.num_kv_heads, h // heads.num_kv_heads * s, d)
