"""Prefill a chunk after the shared prefix and return its KV (K before RoPE).

This is the indexer's work: every chunk is computed once, right after the prefix,
so its tokens see the attention sink they will see at serving time. With context
(neighbour-conditioned KV, FusionRAG-style) the chunk is computed after the prefix and
the context, and only the chunk's own KV is returned, at the positions it was computed
at: its entries already carry attention to the chunks it will likely be served beside.
The context is prefilled with the chunk (its tokens), or taken from the neighbours'
own plain KV (only the chunk's tokens are computed). Serving re-rotates K to the final
positions either way.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ragkv.engine.forward import Keep, Step, layer_steps, span
from ragkv.engine.kv.cache import ChunkKV, KVCache
from ragkv.engine.model_loading import LoadedModel


@torch.inference_mode()
def prefill_steps(lm: LoadedModel, prefix: ChunkKV | None, token_ids: Sequence[int] | torch.Tensor,
                  context_ids: Sequence[int] = (), context_kv: Sequence[ChunkKV] = (),
                  ) -> Generator[Step, None, ChunkKV]:
    """KV of `token_ids` computed after `prefix` (positions P..P+T-1), K before RoPE, one
    decoder layer per step (it yields the tokens each layer computed, so a chunk computed
    while serving is prompt work the scheduler slices like any other).

    With prefix None the segment starts at position 0 (that is how the prefix itself
    is computed). With context, X tokens between the prefix and the segment, the segment
    is computed at positions P+X..P+X+T-1 and only its own KV is returned. The context is
    either `context_ids`, prefilled here with the segment, or `context_kv`, segments whose
    KV is already computed (each neighbour's plain KV): those are placed back to back
    after the prefix, re-rotated, and only the segment's own tokens run through the
    model, so the context costs attention over its keys and no forward of its own.
    """
    if context_ids and context_kv:
        raise ValueError("give the context as token ids or as computed KV, not both")
    dev, ad = lm.device, lm.adapter
    own = torch.as_tensor(token_ids, dtype=torch.long).to(dev)  # [T]
    if own.dim() != 1 or own.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(own.shape)}")
    ctx = torch.as_tensor(list(context_ids), dtype=torch.long).to(dev)  # [X] prefilled with the segment
    ids = torch.cat([ctx, own])  # [X + T]
    p = prefix.num_tokens if prefix is not None else 0
    if context_kv and prefix is None:
        raise ValueError("context_kv needs the prefix it was computed after")
    p += sum(c.num_tokens for c in context_kv)  # context given as KV: it sits with the prefix
    t = ids.shape[0]
    n = p + t
    cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, dev)
    pos = torch.arange(p, n, device=dev)  # [T]
    rope_all = ad.rotary(torch.arange(n, device=dev), torch.empty(0, dtype=lm.dtype, device=dev))
    if prefix is not None:
        cache.write_segments([prefix, *context_kv], rope_all)
    k_out = torch.empty(lm.num_layers, lm.num_kv_heads, t, lm.head_dim, dtype=lm.dtype, device=dev)  # [L, Hkv, T, D]
    v_out = torch.empty_like(k_out)
    # the last layer's output is never needed, only its K/V
    yield from layer_steps(lm, ad.embed(ids), rope_all[p:], span(cache, slice(p, n), pos, n, lm), range(lm.num_layers),
                           Keep.NONE, kv_out=(k_out, v_out))
    x = ctx.shape[0]
    if x == 0:
        return ChunkKV(ids, k_out, v_out, pos, fresh=True, after_context=bool(context_kv))
    own_kv = slice(x, t)  # copies, so the context's KV is freed with this call
    return ChunkKV(own, k_out[:, :, own_kv].contiguous(), v_out[:, :, own_kv].contiguous(), pos[own_kv], fresh=True,
                   after_context=True)


def context_segments(neighbours: Sequence[ChunkKV], budget_tokens: int) -> list[ChunkKV]:
    """Neighbours' computed KV as a chunk's `context_kv`: most similar nearest the chunk, the
    farthest cut (its first tokens dropped) to fit `budget_tokens` (as
    `indexer.neighbours.context_ids` does with tokens).

    Args:
        neighbours: each neighbour's plain KV, most similar first.
    """
    out: list[ChunkKV] = []
    room = budget_tokens
    for kv in neighbours:  # most similar first: it ends up last, next to the chunk
        if room <= 0:
            break
        if kv.num_tokens > room:
            cut = slice(kv.num_tokens - room, kv.num_tokens)
            kv = ChunkKV(kv.token_ids[cut], kv.k[:, :, cut], kv.v[:, :, cut], kv.positions[cut], fresh=kv.fresh)
        out.insert(0, kv)
        room -= kv.num_tokens
    return out
