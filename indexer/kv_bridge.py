"""The one place that converts between kvstore's KVEntry and the engine's ChunkKV.

The indexer writes every chunk's KV through it, and the server (which computes a chunk
missing from every tier on the spot, the indexer's work done late) does too. Both hold K before RoPE as `[L, Hkv, T, D]`, token ids `[T]` and positions
`[T]`; the entry adds the key, fingerprints and prefix hash that name it in the store.
"""

from __future__ import annotations

import torch

from ragkv.engine import ChunkKV, LayerReady
from ragkv.kvstore import ChunkKey, ContextHash, KVEntry, PrefixHash


def entry_to_chunk_kv(entry: KVEntry, device: torch.device, dtype: torch.dtype,
                      ready: LayerReady | None = None) -> ChunkKV:
    """A stored entry as the engine's ChunkKV, on `device` in `dtype`.

    Args:
        ready: the layer gate of an entry still being read (`kvstore.Hit.layers`): its k
            and v stay where they are, in the stored dtype, and the engine's cache copies
            each layer to `device` once the gate has it.
    """
    after_context = entry.context_hash is not None  # neighbour-conditioned KV
    if ready is not None:
        return ChunkKV(entry.token_ids.to(device), entry.k, entry.v, entry.positions.to(device), ready,
                       after_context=after_context)
    return ChunkKV(
        token_ids=entry.token_ids.to(device),  # [T]
        k=entry.k.to(device, dtype),  # [L, Hkv, T, D]
        v=entry.v.to(device, dtype),  # [L, Hkv, T, D]
        positions=entry.positions.to(device),  # [T]
        after_context=after_context,
    )


def chunk_kv_to_entry(
    kv: ChunkKV, key: ChunkKey, model_fp: str, tokenizer_fp: str, prefix_hash: PrefixHash,
    context_hash: ContextHash | None = None,
) -> KVEntry:
    """A computed chunk KV as a store entry under `key` (`context_hash`: neighbour-conditioned KV)."""
    return KVEntry(
        key=key,
        k=kv.k,
        v=kv.v,
        token_ids=kv.token_ids.cpu(),
        positions=kv.positions.cpu(),
        model_fp=model_fp,
        tokenizer_fp=tokenizer_fp,
        prefix_hash=prefix_hash,
        context_hash=context_hash,
    )
