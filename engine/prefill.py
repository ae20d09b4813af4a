"""Prefill a chunk after the shared prefix and return its KV (K before RoPE).

This is the indexer's work: every chunk is computed once, right after the prefix,
so its tokens see the attention sink they will see at serving time. With context
(neighbour-conditioned KV, FusionRAG-style) the chunk is computed after the prefix and
the context's tokens, and only the chunk's own KV is returned, at the positions it was
computed at: its entries already carry attention to the chunks it will likely be
served beside. Serving re-rotates K to the final positions either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragkv.engine.forward import heads_of
from ragkv.engine.forward import layer_forward, plan_attention, project_kv
from ragkv.engine.kv import ChunkKV, KVCache
from ragkv.engine.loading import LoadedModel
from ragkv.engine.rope import rotary_tables


@torch.inference_mode()
def prefill_segment(lm: LoadedModel, prefix: ChunkKV | None, token_ids: Sequence[int] | torch.Tensor,
                    context_ids: Sequence[int] = ()) -> ChunkKV:
    """KV of `token_ids` computed after `prefix` (positions P..P+T-1), K before RoPE.

    With prefix None the segment starts at position 0 (that is how the prefix itself
    is computed). With `context_ids` (X tokens) the segment is computed after the prefix
    and the context, at positions P+X..P+X+T-1; only the segment's own KV is returned.
    """
    dev, heads, model = lm.device, heads_of(lm), lm.model
    own = torch.as_tensor(token_ids, dtype=torch.long).to(dev)  # [T]
    if own.dim() != 1 or own.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(own.shape)}")
    ctx = torch.as_tensor(list(context_ids), dtype=torch.long).to(dev)  # [X]
    ids = torch.cat([ctx, own])  # [X + T]
    p = prefix.num_tokens if prefix is not None else 0
    t = ids.shape[0]
    n = p + t
    cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, dev)
    pos = torch.arange(p, n, device=dev)  # [T]
    cos_all, sin_all = rotary_tables(model, torch.arange(n, device=dev), torch.empty(0, dtype=lm.dtype, device=dev))
    if prefix is not None:
        cache.write_segments([prefix], cos_all, sin_all)
    cos, sin = cos_all[p:], sin_all[p:]  # [T, D]
    attend = plan_attention(pos, n, heads)
    k_out = torch.empty(lm.num_layers, lm.num_kv_heads, t, lm.head_dim, dtype=lm.dtype, device=dev)  # [L, Hkv, T, D]
    v_out = torch.empty_like(k_out)
    h = model.model.embed_tokens(ids)  # [T, hidden]
    layers = model.model.layers
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        if i == last:  # the last layer's output is never needed, only its K/V
            k_out[i], v_out[i] = project_kv(layer, h, heads)
            break
        h, k_out[i], v_out[i] = layer_forward(layer, h, cos, sin, cache, i, slice(p, n), attend, heads)
    x = ctx.shape[0]
    if x == 0:
        return ChunkKV(ids, k_out, v_out, pos, fresh=True)
    own_kv = slice(x, t)  # copies, so the context's KV is freed with this call
    return ChunkKV(own, k_out[:, :, own_kv].contiguous(), v_out[:, :, own_kv].contiguous(), pos[own_kv], fresh=True,
                   after_context=True)
