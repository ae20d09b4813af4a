"""Rotary position embedding, applied with the model's own rotary module.

Using the model's `rotary_emb` keeps RoPE scaling variants (linear, llama3, yarn...)
exactly as the model defines them. HF convention: `x * cos + rotate_half(x) * sin`.
"""

from __future__ import annotations

from typing import Any

import torch


def rotary_tables(model: Any, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for the given positions.

    Args:
        model: a transformers *ForCausalLM whose `.model.rotary_emb` computes the tables.
        positions: [S] int64.
        like: any tensor of the compute dtype and device.

    Returns:
        cos, sin: each [S, D].
    """
    cos, sin = model.model.rotary_emb(like, positions[None, :])  # [1, S, D]
    return cos[0], sin[0]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [..., S, D] by cos, sin: [S, D]."""
    return x * cos + rotate_half(x) * sin


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
