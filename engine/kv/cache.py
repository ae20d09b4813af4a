"""The engine's KV types: a chunk's stored KV and the preallocated decode cache.

Layout is one everywhere: `[L, Hkv, T, D]`. Stored chunk K is *before* RoPE (so it
can be rotated to any final position); the decode cache holds K *after* RoPE.

A chunk may still be arriving (layer-wise loading): its `ready.wait(l)` returns once
layer l of its k and v hold their data. The cache then takes each layer only when the
forward pass reaches it (`KVCache.stage` + `fill`), so reading layer l+1 overlaps the
compute of layer l. A KV tree path read from disk arrives the same way, K already after
RoPE, written where it lies (`KVCache.place`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from ragkv.engine.rope import RopeTables


class LayerReady(Protocol):
    """Says when a chunk's layers hold their data (kvstore's LayerGate is one)."""

    def wait(self, layer: int) -> None:
        """Block until layers [0, layer] are filled; raise if they never will be."""

    @property
    def error(self) -> BaseException | None:
        """Why the layers will never all be filled (the read failed); None = none failed."""

    # Optional: `when_ready(layer) -> Future | None`, None when layers [0, layer] may be read
    # now (or never will: `wait` raises), else a future done once they may be. With it, a
    # request's work parks until its layers arrive (`KVCache.pending`); without, `fill` blocks.


class StoredKV(Protocol):
    """A chunk's KV as a store holds it (kvstore's KVEntry is one): what `ChunkKV.from_stored`
    reads, so the engine needs no import of the store."""

    token_ids: torch.Tensor  # [T] int64
    k: torch.Tensor  # [L, Hkv, T, D], before RoPE
    v: torch.Tensor  # [L, Hkv, T, D]
    positions: torch.Tensor  # [T] int64
    context_hash: object | None  # set for neighbour-conditioned KV


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """One segment's KV as computed after the shared prefix (the prefix itself is one too)."""

    token_ids: torch.Tensor  # [T] int64
    k: torch.Tensor  # [L, Hkv, T, D], before RoPE
    v: torch.Tensor  # [L, Hkv, T, D]
    positions: torch.Tensor  # [T] int64, the positions the KV was computed at
    # still loading: wait(l) before reading layer l of k or v (which stay on the host, in
    # the stored dtype, until the cache copies each layer); None = every layer is there
    ready: LayerReady | None = None
    fresh: bool = False  # computed for this request (prefill), not read from a cache tier
    # computed after context tokens between the prefix and itself (neighbour-conditioned KV):
    # positions start past the prefix; False = right after the prefix
    after_context: bool = False

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"k and v must both be [L, Hkv, T, D]; got k {tuple(self.k.shape)}, "
                             f"v {tuple(self.v.shape)}")
        t = self.k.shape[2]
        if self.token_ids.shape != (t,) or self.positions.shape != (t,):
            raise ValueError(f"token_ids and positions must be [T={t}]; got "
                             f"{tuple(self.token_ids.shape)} and {tuple(self.positions.shape)}")

    @classmethod
    def from_stored(cls, stored: StoredKV, device: torch.device, dtype: torch.dtype,
                    ready: LayerReady | None = None) -> ChunkKV:
        """A stored chunk's KV for the engine, on `device` in `dtype`.

        Args:
            ready: the layer gate of an entry still being read (`kvstore.Hit.layers`): its k
                and v stay where they are, in the stored dtype, and the engine's cache copies
                each layer to `device` once the gate has it.
        """
        after_context = stored.context_hash is not None  # neighbour-conditioned KV
        if ready is not None:
            return cls(stored.token_ids.to(device), stored.k, stored.v, stored.positions.to(device), ready,
                       after_context=after_context)
        return cls(
            token_ids=stored.token_ids.to(device),  # [T]
            k=stored.k.to(device, dtype),  # [L, Hkv, T, D]
            v=stored.v.to(device, dtype),  # [L, Hkv, T, D]
            positions=stored.positions.to(device),  # [T]
            after_context=after_context,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ChunkKV:
        if self.ready is not None:  # its layers are not all there yet: the cache converts each one
            raise RuntimeError("ChunkKV.to on a chunk still loading would copy unfilled layers: a bug")
        return ChunkKV(self.token_ids.to(device), self.k.to(device, dtype), self.v.to(device, dtype),
                       self.positions.to(device), fresh=self.fresh, after_context=self.after_context)

    def moved(self, shift: int) -> ChunkKV:
        """This KV `shift` positions later (earlier when negative), as after context: its chunk
        was computed after another prefix than the prompt's (a request with its own
        instructions), so it is not the prompt's exact KV and blending treats it as any
        non-prefix reuse. K stays before RoPE: the cache rotates it to where it lands."""
        if shift == 0 and self.after_context:
            return self
        return dataclasses.replace(self, positions=self.positions + shift, after_context=True)

    def first_layers(self, n: int) -> ChunkKV:
        """This chunk's layers [0, n) (views, still loading if this one is)."""
        return dataclasses.replace(self, k=self.k[:n], v=self.v[:n])


def layers_pending(segments: Sequence[ChunkKV], layer: int) -> list[Future[None]]:
    """Futures of the segments still loading whose layers [0, layer] are not all there (a
    segment with fewer layers is asked for its last one)."""
    return [f for seg in segments if (f := _when_ready(seg.ready, seg.k.shape[0], layer)) is not None]


def arriving(ready: LayerReady | None, num_layers: int) -> bool:
    """Whether KV still loading has layers to come (False once all are there, or the read failed)."""
    return _when_ready(ready, num_layers, num_layers - 1) is not None


def _when_ready(ready: LayerReady | None, num_layers: int, layer: int) -> Future[None] | None:
    """The future done once layers [0, layer] (at most its last) of KV still loading may be
    read; None when they may be now, or it cannot say (`LayerReady.when_ready` is optional)."""
    if ready is None or not hasattr(ready, "when_ready"):
        return None
    return ready.when_ready(min(layer, num_layers - 1))  # type: ignore[no-any-return]


class CachePool(Protocol):
    """Where a cache's KV may live besides its own tensors (`engine.kv.decode_pool.DecodePool`)."""

    def grow(self, cache: KVCache, tokens: int) -> None:
        """Give `cache` room for `tokens` tokens, its k and v still views of the pool."""


class KVCache:
    """A preallocated decode cache; K after RoPE. Grows by doubling, never per token."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        k = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)  # [L, Hkv, cap, D]
        self._start(k, torch.empty_like(k))

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """An empty cache over given tensors [L, Hkv, cap, D] (a decode pool's run), allocating none."""
        cache = cls.__new__(cls)
        cache._start(k, v)
        return cache

    def _start(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k  # [L, Hkv, cap, D]
        self.v = v  # [L, Hkv, cap, D]
        self.length = 0  # tokens [0, length) hold valid K/V
        self._staged: _Staged | None = None  # segments whose layers fill as the pass reaches them
        # a hybrid's recurrent layers: their conv and recurrent state after tokens [0, length)
        # (`Adapter.new_recurrent_state`, made at the first pass); their K/V slots stay unused
        self.recurrent: object | None = None
        # a position whose recurrent state is wanted too (the KV tree's snapshot): each recurrent
        # layer's pass stops there, copies its state into `marked`, and goes on
        self.mark: int | None = None
        self.marked: object | None = None
        # the decode pool that holds this cache's KV once it decodes there (`engine.kv.decode_pool`):
        # k and v are then views of the pool's tensors, and the pool grows them
        self.pool: CachePool | None = None
        self.run: object | None = None  # its place in `pool` (the pool's own record)
        # slots [0, from_tree) hold a copy of a KV tree path (a lease's `write_into`): the tree may
        # keep those nodes in these slots instead of its own, when both are the same pool's (`KVTree._rehome`)
        self.from_tree = 0
        # the most tokens it will hold (its prompt and max_new_tokens: what admission counted); None =
        # unknown. Growth by doubling stops there, so a request never holds more than it was admitted for
        self.most: int | None = None

    def write_segments(self, segments: Sequence[ChunkKV], rope: RopeTables) -> int:
        """Write stored segments back to back from slot 0, rotating each K to its final positions.

        Args:
            rope: rotary tables of positions 0, 1, ... (at least the total T rows)

        Returns:
            The number of slots written.
        """
        off = 0
        for seg in segments:
            t = seg.num_tokens
            if seg.ready is not None:
                seg.ready.wait(seg.k.shape[0] - 1)
            k = seg.k.to(self.k.device, self.k.dtype)  # [L, Hkv, T, D], before RoPE
            rope[off:off + t].rotate_into(self.k[:, :, off:off + t], k, slice(None))
            self.v[:, :, off:off + t] = seg.v.to(self.v.device, self.v.dtype)
            off += t
        return off

    def stage(self, segments: Sequence[ChunkKV], rope: RopeTables,
              divide_k: tuple[int, float] | None = None) -> None:
        """Write stored segments back to back from slot 0: now when all are loaded, else layer
        by layer as `fill` asks (each layer waits for its data then, not before).

        Args:
            rope: rotary tables of positions 0, 1, ... (at least the total T rows)
            divide_k: (first slot, d): K of slots [first slot, total T) is divided by d
                (APE-style context temperature).
        """
        if all(seg.ready is None for seg in segments):
            self._divide_k(slice(None), self.write_segments(segments, rope), divide_k)
            return
        placed = self._staged.placed if self._staged is not None else []
        self._staged = _Staged(tuple(segments), rope, divide_k,
                               min([seg.k.shape[0] for seg in segments] + [p.k.shape[0] for p in placed]), placed)

    def place(self, start: int, k: torch.Tensor, v: torch.Tensor, ready: LayerReady) -> None:
        """Write KV that needs no rotation (K after RoPE: the KV tree's, read from disk) into
        slots [start, start + T), layer by layer as `fill` asks, each layer once `ready` has it.

        Args:
            k, v: [L, Hkv, T, D], filling in as `ready` publishes their layers.
        """
        part = _Placed(start, k, v, ready)
        if self._staged is None:
            self._staged = _Staged((), None, None, k.shape[0], [part])
        else:
            self._staged.placed.append(part)
            self._staged.num_layers = min(self._staged.num_layers, k.shape[0])

    def fill(self, layer: int) -> None:
        """Make layers [0, layer] of the staged segments present (a no-op once they are)."""
        st = self._staged
        if st is None or layer < st.next_layer:
            return
        for i in range(st.next_layer, layer + 1):
            off = 0
            for seg in st.segments:
                t = seg.num_tokens
                if seg.ready is not None:
                    seg.ready.wait(i)
                k = seg.k[i].to(self.k.device, self.k.dtype, non_blocking=True)  # [Hkv, T, D], before RoPE
                if st.rope is not None:
                    st.rope[off:off + t].rotate_into(self.k[i, :, off:off + t], k, i)
                self.v[i, :, off:off + t] = seg.v[i].to(self.v.device, self.v.dtype, non_blocking=True)
                off += t
            self._divide_k(i, off, st.divide_k)
            for part in st.placed:
                part.ready.wait(i)
                s, t = part.start, part.k.shape[2]
                self.k[i, :, s:s + t] = part.k[i].to(self.k.device, self.k.dtype, non_blocking=True)  # [Hkv, T, D]
                self.v[i, :, s:s + t] = part.v[i].to(self.v.device, self.v.dtype, non_blocking=True)
        st.next_layer = layer + 1
        if st.next_layer >= st.num_layers:
            self._staged = None

    def pending(self, layer: int) -> list[Future[None]]:
        """Futures of the staged segments whose layers [0, layer] are still arriving (empty: `fill`
        will not block). A request's work yields a WaitFor on them instead of blocking in `fill`."""
        st = self._staged
        if st is None or layer < st.next_layer:
            return []
        return layers_pending(st.segments, layer) + [
            f for p in st.placed if (f := _when_ready(p.ready, p.k.shape[0], layer)) is not None]

    def _divide_k(self, layers: slice | int, n: int, divide_k: tuple[int, float] | None) -> None:
        """K of slots [divide_k[0], n) at `layers`, divided by divide_k[1] (context temperature)."""
        if divide_k is not None:
            self.k[layers, :, divide_k[0]:n] /= divide_k[1]

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def doubled(self) -> int:
        """Twice its capacity, or the most it will hold when that is less (`most`)."""
        return 2 * self.capacity if self.most is None else min(2 * self.capacity, self.most)

    def ensure(self, capacity: int) -> None:
        """Make room for `capacity` tokens, copying the valid part once if it must grow."""
        if capacity <= self.capacity:
            return
        if self.pool is not None:
            self.pool.grow(self, capacity)
            return
        new_cap = max(capacity, self.doubled())
        L, H, _, D = self.k.shape
        k = torch.empty(L, H, new_cap, D, dtype=self.k.dtype, device=self.k.device)  # [L, Hkv, cap, D]
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v


@dataclass(slots=True)
class _Staged:
    """Segments `KVCache.stage` has yet to write, from layer `next_layer` on."""

    segments: tuple[ChunkKV, ...]
    rope: RopeTables | None  # at positions 0, 1, ... (>= total T rows); None when no segment
    divide_k: tuple[int, float] | None  # (first slot, divisor) or None
    num_layers: int  # layers every segment and placed part has
    placed: list[_Placed] = dataclasses.field(default_factory=list)  # KV written where it lies, unrotated
    next_layer: int = 0  # layers [0, next_layer) are written


@dataclass(frozen=True, slots=True)
class _Placed:
    """KV after RoPE that `KVCache.place` writes at its slots as its layers arrive."""

    start: int  # its first slot
    k: torch.Tensor  # [L, Hkv, T, D], after RoPE
    v: torch.Tensor  # [L, Hkv, T, D]
    ready: LayerReady
