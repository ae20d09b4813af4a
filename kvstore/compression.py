"""Lossy compression of K and V in stored files, as layer-major packed rows.

Formats (`Compression`):
- INT8 / FP8: one scale per channel (layer, KV head, head-dim lane), taken over the chunk's
  tokens, so one outlier token does not flatten a whole head. Scales float32.
- INT4 / INT2 (KIVI's layout, asymmetric): keys per channel in groups of `KEY_GROUP`
  tokens, values per token in groups of `VALUE_GROUP` head-dim lanes (a head of fewer
  lanes, or one they do not divide, is one group), each group with a float16 scale and
  minimum. Keys carry outlier channels (a few lanes 10x the rest): a scale per channel
  keeps them from flattening the others; values do not, and are quantized per token.
  Codes are packed low bits first, 8 / bits to a byte along the head dim.

A compressed K (or V) is stored as one uint8 tensor `[L, B]`: row l holds every byte of
layer l (its scales first, then its codes, each part padded to 8 bytes), so a reader
can dequantize layer l as soon as row l is in (`unpack`, device-agnostic: move the row
to the engine's device, dequantize there).

Stated round-trip tolerance, per element x (plus the rounding of the stored dtype):
- INT8: |x' - x| <= a / 254, a the channel's absolute maximum (half a step of a/127).
- FP8 (e4m3fn, where torch has it): |x' - x| <= |x| / 16 + a * 2**-17 (3 mantissa bits;
  the second term covers subnormals).
- INT4 / INT2: |x' - x| <= s / 2 + 2**-10 * (|m| + q * s), s = (max - min) / q over x's group,
  m its minimum, q = 2**bits - 1 (half a step, plus float16's rounding of s and m).

Knows nothing of files or tiers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import torch

INT8_MAX = 127.0
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)  # None on a torch without fp8
FP8_MAX = 448.0  # largest finite e4m3fn value
KEY_GROUP = 32  # INT4/INT2: tokens sharing one key scale per channel
VALUE_GROUP = 32  # INT4/INT2: head-dim lanes sharing one value scale per token
_ALIGN = 8  # every part of a packed row starts at a multiple of this (float32 views need 4)
_F16_MAX = 65504.0


class Compression(str, Enum):
    """How a store writes K and V into files (memory tiers always hold the original dtype)."""

    NONE = "none"  # bit-exact, in the entry's dtype
    INT8 = "int8"  # int8 values, float32 per-channel scales: half of bf16's bytes
    FP8 = "fp8"  # float8_e4m3fn values, float32 per-channel scales
    INT4 = "int4"  # KIVI 4-bit: keys per channel, values per token, float16 scale + min per group
    INT2 = "int2"  # KIVI 2-bit, same groups


_BITS = {Compression.INT4: 4, Compression.INT2: 2}


def fp8_supported() -> bool:
    """Whether this torch build has float8_e4m3fn."""
    return FP8_DTYPE is not None


def check_supported(compression: Compression | str) -> Compression:
    """Return `compression` if this torch can run it, else raise ValueError."""
    compression = Compression(compression)
    if compression is Compression.FP8 and not fp8_supported():
        raise ValueError(f"compression {compression.value!r} needs torch.float8_e4m3fn (torch {torch.__version__})")
    return compression


def quantize(x: torch.Tensor, compression: Compression) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` per channel (INT8, FP8).

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
    raise ValueError(f"quantize needs INT8 or FP8, got {compression!r} (INT4/INT2: use pack)")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize`: `[..., T, D]` in `dtype`, written into `out` when given.

    Int8 codes are multiplied in one pass, the product cast as it is written (the same bits
    as widening first); float8 codes, which torch does not promote, are widened first."""
    if q.dtype == torch.int8:
        if out is None:
            out = torch.empty(q.shape, dtype=dtype, device=q.device)
        return torch.mul(q, scale, out=out)  # [..., T, D]
    deq = (q.float() * scale).to(dtype)  # [..., T, D]
    return deq if out is None else out.copy_(deq)


@dataclass(slots=True)
class DequantClock:
    """Time one read spent dequantizing (wall time on the host: on a GPU, the kernels' launch
    and the rows' copy, not the kernels, which the device queues behind them)."""

    seconds: float = 0.0  # spent in `unpack`
    elements: int = 0  # K/V elements it produced


@dataclass(frozen=True, slots=True)
class Part:
    """One tensor of a packed layer row."""

    name: str  # "scale", "min" or "codes"
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]  # one layer's shape
    start: int  # byte offset in the row
    nbytes: int  # bytes it holds (the row pads it to _ALIGN)


def _value_group(d: int) -> int:
    return VALUE_GROUP if d % VALUE_GROUP == 0 else d


def layer_parts(compression: Compression, role: str, hkv: int, t: int, d: int) -> tuple[Part, ...]:
    """The parts of one layer's row of `role` ("k" or "v") for `[Hkv, T, D]` tensors.

    Raises:
        ValueError: NONE (not packed), an unknown role, or a head dim the codes cannot pack.
    """
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    specs: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    if compression in (Compression.INT8, Compression.FP8):
        code_dtype = torch.int8 if compression is Compression.INT8 else FP8_DTYPE
        assert code_dtype is not None, "check_supported first"
        specs = [("scale", torch.float32, (hkv, 1, d), 4), ("codes", code_dtype, (hkv, t, d), 1)]
    elif compression in _BITS:
        per = 8 // _BITS[compression]
        if d % per:
            raise ValueError(f"{compression.value} packs {per} lanes a byte; head dim {d} is not a multiple of {per}")
        groups = (hkv, -(-t // KEY_GROUP), d) if role == "k" else (hkv, t, d // _value_group(d))
        specs = [("scale", torch.float16, groups, 2), ("min", torch.float16, groups, 2),
                 ("codes", torch.uint8, (hkv, t, d // per), 1)]
    else:
        raise ValueError(f"layer_parts needs a compressed format, got {compression!r}")
    parts, start = [], 0
    for name, dtype, shape, size in specs:
        n = size
        for s in shape:
            n *= s
        parts.append(Part(name, dtype, shape, start, n))
        start += -(-n // _ALIGN) * _ALIGN
    return tuple(parts)


def row_bytes(compression: Compression, role: str, hkv: int, t: int, d: int) -> int:
    """B, the bytes of one packed layer row."""
    last = layer_parts(compression, role, hkv, t, d)[-1]
    return last.start + -(-last.nbytes // _ALIGN) * _ALIGN


def stored_bytes_per_token(compression: Compression, shape: tuple[int, int, int, int], dtype_bytes: int = 2) -> float:
    """K and V bytes a file stores per token (scales included; ids, positions and header not),
    for a chunk of `shape` (L, Hkv, T, D); `dtype_bytes` is the uncompressed element size."""
    n_layers, hkv, t, d = shape
    if compression is Compression.NONE:
        return 2.0 * n_layers * hkv * d * dtype_bytes
    rows = row_bytes(compression, "k", hkv, t, d) + row_bytes(compression, "v", hkv, t, d)
    return n_layers * rows / max(t, 1)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[..., D]` uint8 codes below 2**bits -> `[..., D * bits / 8]` uint8, low bits first."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # [per]
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)  # [..., D/per, per]
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)  # [..., D/per]; fields are disjoint


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_codes`: `[..., D/per]` uint8 -> `[..., D]` uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # [per]
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., D/per, per]
    return codes.reshape(*packed.shape[:-1], -1)  # [..., D]


def _kivi_quantize(x: torch.Tensor, role: str, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, min, packed codes) of `x` `[L, Hkv, T, D]` in KIVI's groups (module docstring)."""
    n_layers, hkv, t, d = x.shape
    qmax = float((1 << bits) - 1)
    xf = x.float()  # [L, Hkv, T, D]
    if role == "k":  # per channel, groups of KEY_GROUP tokens; the last group padded with its last token
        n_groups = -(-t // KEY_GROUP)
        pad = n_groups * KEY_GROUP - t
        padded = torch.cat([xf, xf[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else xf  # [L, Hkv, Tp, D]
        grouped = padded.reshape(n_layers, hkv, n_groups, KEY_GROUP, d)  # [L, Hkv, Tg, G, D]
        lo, hi = grouped.amin(dim=3), grouped.amax(dim=3)  # [L, Hkv, Tg, D]
    else:  # per token, groups of VALUE_GROUP lanes
        g = _value_group(d)
        grouped = xf.reshape(n_layers, hkv, t, d // g, g)  # [L, Hkv, T, D/g, g]
        lo, hi = grouped.amin(dim=4), grouped.amax(dim=4)  # [L, Hkv, T, D/g]
    if bool(hi.abs().max() > _F16_MAX) or bool(lo.abs().max() > _F16_MAX):
        raise ValueError(f"int{bits} keeps scales in float16; K/V values past {_F16_MAX} do not fit: store int8")
    scale = ((hi - lo) / qmax).half()  # [groups]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a flat group (or one underflowed): any scale
    mn = lo.half()  # [groups]
    s_full, m_full = _expand(scale.float(), role, t, d), _expand(mn.float(), role, t, d)  # [L, Hkv, T, D]
    codes = torch.round((xf - m_full) / s_full).clamp_(0, qmax).to(torch.uint8)  # [L, Hkv, T, D]
    return scale, mn, _pack_codes(codes, bits)


def _expand(g: torch.Tensor, role: str, t: int, d: int) -> torch.Tensor:
    """Group values `[..., Tg, D]` (keys) or `[..., T, D/g]` (values) -> one per element `[..., T, D]`."""
    if role == "k":
        return g.repeat_interleave(KEY_GROUP, dim=-2)[..., :t, :]  # [..., T, D]
    return g.repeat_interleave(_value_group(d), dim=-1)  # [..., T, D]


def pack(x: torch.Tensor, compression: Compression, role: str) -> torch.Tensor:
    """`x` `[L, Hkv, T, D]` as packed layer rows `[L, B]` uint8 (on x's device).

    Args:
        role: "k" or "v" (INT4/INT2 quantize keys per channel, values per token).
    """
    compression = check_supported(compression)
    n_layers, hkv, t, d = x.shape
    parts = layer_parts(compression, role, hkv, t, d)
    if compression in _BITS:
        tensors = dict(zip(("scale", "min", "codes"), _kivi_quantize(x, role, _BITS[compression]), strict=True))
    else:
        q, scale = quantize(x, compression)
        tensors = {"scale": scale, "codes": q}
    rows = torch.zeros(n_layers, row_bytes(compression, role, hkv, t, d), dtype=torch.uint8, device=x.device)  # [L, B]
    for p in parts:
        raw = tensors[p.name].contiguous().reshape(n_layers, -1).view(torch.uint8)  # [L, nbytes]
        rows[:, p.start:p.start + p.nbytes] = raw
    return rows


def round_trip(x: torch.Tensor, compression: Compression | str, role: str) -> torch.Tensor:
    """`x` `[L, Hkv, T, D]` as a file stored with `compression` gives it back: quantized and
    dequantized on x's device, in x's dtype (NONE: `x` itself, files keep it bit-exact). KV
    computed at serving time is served this way, so a chunk computed answers as its stored
    copy will (a cache that reuses KV changes no answer).

    Args:
        role: "k" or "v".
    """
    compression = check_supported(compression)
    if compression is Compression.NONE:
        return x
    _, hkv, t, d = x.shape
    return unpack(pack(x, compression, role), compression, role, (hkv, t, d), x.dtype)


def unpack(rows: torch.Tensor, compression: Compression, role: str, shape: tuple[int, int, int],
           dtype: torch.dtype, clock: DequantClock | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize packed rows `[n, B]` uint8 (n layers, on any device) into `[n, Hkv, T, D]` in `dtype`.

    Vectorised over layers, heads, tokens and lanes; runs where `rows` is (move a row to the
    engine's device first and it dequantizes there).

    Args:
        shape: (Hkv, T, D) of one layer.
        clock: adds the time spent here.
        out: a contiguous `[n, Hkv, T, D]` tensor in `dtype` to write into (a layered read's
            layer of its chunk), so no dequantized copy is made and copied again.
    """
    started = time.perf_counter()
    if out is not None and (out.dtype != dtype or not out.is_contiguous() or out.shape != (rows.shape[0], *shape)):
        raise ValueError(f"out must be a contiguous {(rows.shape[0], *shape)} {dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    deq = _unpack(rows, compression, role, shape, dtype, out)  # [n, Hkv, T, D]
    if clock is not None:
        clock.seconds += time.perf_counter() - started
        clock.elements += deq.numel()
    return deq


def _unpack(rows: torch.Tensor, compression: Compression, role: str, shape: tuple[int, int, int],
            dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    hkv, t, d = shape
    n = rows.shape[0]
    views = {}
    for p in layer_parts(compression, role, hkv, t, d):
        views[p.name] = rows[:, p.start:p.start + p.nbytes].view(p.dtype).reshape(n, *p.shape)
    if compression in _BITS:
        codes = _unpack_codes(views["codes"], _BITS[compression])  # [n, Hkv, T, D] uint8
        return _dequantize_groups(codes, views["scale"], views["min"], role, dtype, out)  # [n, Hkv, T, D]
    return dequantize(views["codes"], views["scale"], dtype, out)  # [n, Hkv, T, D]


def _dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, role: str,
                       dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """min + code * scale over KIVI's groups, each group's scale and min broadcast over it (no
    tensor of them per element): codes `[n, Hkv, T, D]` uint8, keys' groups `[n, Hkv, Tg, D]`,
    values' `[n, Hkv, T, D/g]`. The codes widen inside the one pass that computes in float32 and
    writes `dtype` (into `out` when given, a contiguous `[n, Hkv, T, D]`)."""
    n, hkv, t, d = codes.shape
    if out is None:
        out = torch.empty(n, hkv, t, d, dtype=dtype, device=codes.device)
    if role == "v":
        g = _value_group(d)
        torch.addcmul(mn.float().unsqueeze(-1), codes.reshape(n, hkv, t, d // g, g), scale.float().unsqueeze(-1),
                      out=out.view(n, hkv, t, d // g, g))  # [n, Hkv, T, D/g, g]
        return out
    tg = scale.shape[2]
    if tg * KEY_GROUP == t:
        torch.addcmul(mn.float().unsqueeze(3), codes.reshape(n, hkv, tg, KEY_GROUP, d), scale.float().unsqueeze(3),
                      out=out.view(n, hkv, tg, KEY_GROUP, d))  # [n, Hkv, Tg, G, D]
        return out
    # the last group is short: its codes padded to a whole group, the padding cut on the way out
    codes = torch.cat([codes, codes.new_zeros(n, hkv, tg * KEY_GROUP - t, d)], dim=2)
    full = torch.addcmul(mn.float().unsqueeze(3), codes.reshape(n, hkv, tg, KEY_GROUP, d),
                         scale.float().unsqueeze(3))  # [n, Hkv, Tg, G, D] float32
    return out.copy_(full.reshape(n, hkv, tg * KEY_GROUP, d)[:, :, :t])
