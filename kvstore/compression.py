"""Optional lossy compression of K and V in stored files: int8 or fp8 with per-channel scales.

A channel is one (layer, KV head, head-dim lane): its scale is taken over the
chunk's tokens, so one outlier token does not flatten a whole head. Scales are
float32, `[L, Hkv, 1, D]`, stored beside the quantized tensor.

Stated round-trip tolerance, per element x of a channel with absolute maximum a:
- INT8: |x' - x| <= a / 254 (half a step of a/127), plus the rounding of the stored dtype.
- FP8 (e4m3fn, where torch has it): |x' - x| <= |x| / 16 + a * 2**-17, plus the rounding
  of the stored dtype (3 mantissa bits; the second term covers subnormals).

Knows nothing of files or tiers.
"""

from __future__ import annotations

from enum import Enum

import torch

INT8_MAX = 127.0
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)  # None on a torch without fp8
FP8_MAX = 448.0  # largest finite e4m3fn value


class Compression(str, Enum):
    """How a store writes K and V into files (memory tiers always hold the original dtype)."""

    NONE = "none"  # bit-exact, in the entry's dtype
    INT8 = "int8"  # int8 values, float32 per-channel scales: half of fp16's bytes
    FP8 = "fp8"  # float8_e4m3fn values, float32 per-channel scales


def fp8_supported() -> bool:
    """Whether this torch build has float8_e4m3fn."""
    return FP8_DTYPE is not None


def check_supported(compression: Compression) -> Compression:
    """Return `compression` if this torch can run it, else raise ValueError."""
    compression = Compression(compression)
    if compression is Compression.FP8 and not fp8_supported():
        raise ValueError(f"compression {compression.value!r} needs torch.float8_e4m3fn (torch {torch.__version__})")
    return compression


def quantize(x: torch.Tensor, compression: Compression) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` per channel.

    Args:
        x: `[L, Hkv, T, D]` float tensor.
        compression: INT8 or FP8.

    Returns:
        (q, scale): q `[L, Hkv, T, D]` int8 or float8_e4m3fn, scale `[L, Hkv, 1, D]` float32.
    """
    xf = x.float()  # [L, Hkv, T, D]
    amax = xf.abs().amax(dim=2, keepdim=True)  # [L, Hkv, 1, D]
    if compression is Compression.INT8:
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))  # [L, Hkv, 1, D]
        q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # [L, Hkv, T, D]
        return q, scale
    if compression is Compression.FP8:
        check_supported(compression)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [L, Hkv, 1, D]
        q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [L, Hkv, T, D]
        return q, scale
    raise ValueError(f"quantize needs INT8 or FP8, got {compression!r}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: `[L, Hkv, T, D]` in `dtype`."""
    return (q.float() * scale).to(dtype)  # [L, Hkv, T, D]
