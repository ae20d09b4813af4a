"""The engine's KV types: a chunk's stored KV and the preallocated decode cache.

Layout is one everywhere: `[L, Hkv, T, D]`. Stored chunk K is *before* RoPE (so it
can be rotated to any final position); the decode cache holds K *after* RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

import torch

from engine.rope import rotate_into


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """One segment's KV as computed after the shared prefix (the prefix itself is one too)."""

    token_ids: torch.Tensor  # [T] int64
    k: torch.Tensor  # [L, Hkv, T, D], before RoPE
    v: torch.Tensor  # [L, Hkv, T, D]
    positions: torch.Tensor  # [T] int64, the positions the KV was computed at

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"k and v must both be [L, Hkv, T, D]; got k {tuple(self.k.shape)}, "
                             f"v {tuple(self.v.shape)}")
        t = self.k.shape[2]
        if self.token_ids.shape != (t,) or self.positions.shape != (t,):
            raise ValueError(f"token_ids and positions must be [T={t}]; got "
                             f"{tuple(self.token_ids.shape)} and {tuple(self.positions.shape)}")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ChunkKV:
        return ChunkKV(self.token_ids.to(device), self.k.to(device, dtype), self.v.to(device, dtype),
                       self.positions.to(device))


class KVCache:
    """A preallocated decode cache; K after RoPE. Grows by doubling, never per token."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)  # [L, Hkv, cap, D]
        self.v = torch.empty_like(self.k)  # [L, Hkv, cap, D]
        self.length = 0  # tokens [0, length) hold valid K/V

    def write_segments(self, segments: Sequence[ChunkKV], cos: torch.Tensor, sin: torch.Tensor) -> int:
        """Write stored segments back to back from slot 0, rotating each K to its final positions.

        Args:
            cos, sin: [>= total T, D] rotary tables of positions 0, 1, ...

        Returns:
            The number of slots written.
        """
        off = 0
        for seg in segments:
            t = seg.num_tokens
            k = seg.k.to(self.k.device, self.k.dtype)  # [L, Hkv, T, D], before RoPE
            rotate_into(self.k[:, :, off:off + t], k, cos[off:off + t], sin[off:off + t])
            self.v[:, :, off:off + t] = seg.v.to(self.v.device, self.v.dtype)
            off += t
        return off

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def ensure(self, capacity: int) -> None:
        """Make room for `capacity` tokens, copying the valid part once if it must grow."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        L, H, _, D = self.k.shape
        k = torch.empty(L, H, new_cap, D, dtype=self.k.dtype, device=self.k.device)  # [L, Hkv, cap, D]
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v
