"""The one place that converts between kvstore's KVEntry and the engine's ChunkKV.

Both hold K before RoPE as `[L, Hkv, T, D]`, token ids `[T]` and positions `[T]`;
the entry adds the key, fingerprints and prefix hash that name it in the store.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import ChunkKV, LayerReady
from kvstore import ChunkKey, KVEntry, hash_prefix


def entry_to_chunk_kv(entry: KVEntry, device: torch.device, dtype: torch.dtype,
                      ready: LayerReady | None = None) -> ChunkKV:
    """A stored entry as the engine's ChunkKV, on `device` in `dtype`.

    Args:
        ready: the layer gate of an entry still being read (`kvstore.Hit.layers`): its k
            and v stay where they are, in the stored dtype, and the engine's cache copies
            each layer to `device` once the gate has it.
    """
    if ready is not None:
        return ChunkKV(entry.token_ids.to(device), entry.k, entry.v, entry.positions.to(device), ready)
    return ChunkKV(
        token_ids=entry.token_ids.to(device),  # [T]
        k=entry.k.to(device, dtype),  # [L, Hkv, T, D]
        v=entry.v.to(device, dtype),  # [L, Hkv, T, D]
        positions=entry.positions.to(device),  # [T]
    )


def chunk_kv_to_entry(
    kv: ChunkKV, key: str, model_fp: str, tokenizer_fp: str, prefix_ids: Sequence[int]
) -> KVEntry:
    """A freshly computed chunk KV as a store entry under `key` (a ChunkKey string)."""
    return KVEntry(
        key=ChunkKey.from_str(key),
        k=kv.k,
        v=kv.v,
        token_ids=kv.token_ids.cpu(),
        positions=kv.positions.cpu(),
        model_fp=model_fp,
        tokenizer_fp=tokenizer_fp,
        prefix_hash=hash_prefix(list(prefix_ids)),
    )


def placeholder_kv(
    token_ids: Sequence[int], start: int, shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype
) -> ChunkKV:
    """A chunk with its tokens but no real KV, for modes that recompute every chunk token.

    The K/V are a zero-stride view of one zero, so no memory is spent on them.

    Args:
        token_ids: The chunk's tokens.
        start: Its first position (the prefix length).
        shape: (L, Hkv, D) of the model.
    """
    n = len(token_ids)
    layers, heads, dim = shape
    zeros = torch.zeros((), device=device, dtype=dtype).expand(layers, heads, n, dim)  # [L, Hkv, T, D]
    return ChunkKV(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long, device=device),  # [T]
        k=zeros,
        v=zeros,
        positions=torch.arange(start, start + n, device=device),  # [T]
    )
