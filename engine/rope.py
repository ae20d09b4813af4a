"""Rotary position embedding, with the tables from the model's own rotary modules.

Using the model's rotary module keeps RoPE scaling variants (linear, llama3, yarn...)
exactly as the model defines them. HF convention: `x * cos + rotate_half(x) * sin`,
over the first R dims of each head (R < D: partial rotary), with halves split
down the middle or interleaved (Cohere). A model may rotate its layers differently
(Gemma 3: local and global tables; SmolLM3: some layers not at all): `RopeTables`
holds one table per rotary kind and says which kind each layer uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeTables:
    """Rotary tables at S positions, for every layer of a model."""

    cos: tuple[torch.Tensor, ...]  # one [S, R] table per rotary kind
    sin: tuple[torch.Tensor, ...]
    kind: tuple[int, ...]  # per layer: its index into cos/sin; -1 = the layer has no RoPE
    interleaved: bool = False  # rotate pairs (0, 1), (2, 3)... instead of halves
    q_scale: torch.Tensor | None = None  # [S] float32: queries of no-RoPE layers are scaled (Llama 4)

    def __getitem__(self, rows: slice | torch.Tensor) -> RopeTables:
        """The tables at a subset of the positions (rows)."""
        return RopeTables(tuple(c[rows] for c in self.cos), tuple(s[rows] for s in self.sin), self.kind,
                          self.interleaved, None if self.q_scale is None else self.q_scale[rows])

    @staticmethod
    def cat(tables: Sequence[RopeTables]) -> RopeTables:
        """Several passes' tables, one after the other (their rows side by side in one step:
        `engine.forward.run_layers`); they must be of one model (the same kinds)."""
        first = tables[0]
        scales = [t.q_scale for t in tables if t.q_scale is not None]
        q_scale = torch.cat(scales) if len(scales) == len(tables) else None
        return RopeTables(tuple(torch.cat([t.cos[j] for t in tables]) for j in range(len(first.cos))),
                          tuple(torch.cat([t.sin[j] for t in tables]) for j in range(len(first.sin))),
                          first.kind, first.interleaved, q_scale)

    def inverse(self) -> RopeTables:
        """The tables that undo these rotations (`apply` with them turns K after RoPE back into K
        before it: a rotation's inverse is the rotation by minus its angle)."""
        return RopeTables(self.cos, tuple(-s for s in self.sin), self.kind, self.interleaved)

    def scale_query(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [H, S, D] as `layer` scales queries: by position on a no-RoPE layer when the
        model tunes their temperature (Llama 4), else unchanged."""
        if self.q_scale is None or self.kind[layer] >= 0:
            return q
        return (q * self.q_scale[:, None]).to(q.dtype)

    def apply(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x: [..., S, D] rotated as `layer` rotates (a no-RoPE layer returns x itself)."""
        j = self.kind[layer]
        if j < 0:
            return x
        cos, sin = self.cos[j], self.sin[j]  # [S, R]
        r = cos.shape[-1]
        if r == x.shape[-1]:
            return apply_rope(x, cos, sin, self.interleaved)
        return torch.cat([apply_rope(x[..., :r], cos, sin, self.interleaved), x[..., r:]], -1)

    def rotate_into(self, out: torch.Tensor, x: torch.Tensor, layers: slice | int) -> None:
        """out = apply(x) for `layers` (x, out: [L', Hkv, T, D] for a slice, [Hkv, T, D] for one layer),
        written in place; the tables' rows are the T positions."""
        if isinstance(layers, int):
            self._rotate_one(out, x, self.kind[layers])
            return
        kinds = self.kind[layers][: x.shape[0]]  # x may hold only the first layers
        if len(set(kinds)) == 1:  # every layer rotates alike (most models): one call for all
            self._rotate_one(out, x, kinds[0])
            return
        for i, j in enumerate(kinds):
            self._rotate_one(out[i], x[i], j)

    def _rotate_one(self, out: torch.Tensor, x: torch.Tensor, j: int) -> None:
        if j < 0:
            out.copy_(x)
            return
        cos, sin = self.cos[j], self.sin[j]  # [T, R]
        r = cos.shape[-1]
        if self.interleaved:
            out[..., :r] = apply_rope(x[..., :r], cos, sin, True)
        else:
            rotate_into(out[..., :r], x[..., :r], cos, sin)
        if r < x.shape[-1]:
            out[..., r:] = x[..., r:]


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x: [..., S, R] by cos, sin: [S, R]."""
    return x * cos + rotate_half(x, interleaved) * sin


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = apply_rope(x, cos, sin), written in place without whole-size temporaries.

    For the cache's bulk writes (every layer of every chunk): half-size temporaries
    instead of five fresh [..., S, D] buffers. Same products and sums as apply_rope, so
    the same bits (no fused multiply-add): reused K equals prefilled K exactly.
    """
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
