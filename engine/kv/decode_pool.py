"""Requests' KV in one pair of device tensors: what a shape-static decode step reads.

A request's prompt pass takes its cache from the pool (`new_cache`: one run of slots, the
`KVCache` holding views of it), so it decodes where its prompt left its KV, with no copy; a
cache made outside the pool (the pool was full) moves in once when it starts to decode
(`admit`). Every other part of the engine (the tree's insert after the answer, a follow-up's
reads) sees the cache's tensors as before. The pool's tensors never move while it lives, so a captured CUDA
graph can address every request's KV by offsets held in device buffers (`engine.decode_graphs`):
a request is `(start, length)` in one `[L, Hkv, S, D]` tensor, not a tensor of its own.

Runs are whole pages (`page_tokens`) and first-fit; a run that must grow takes the pages after
it when they are free, else moves once to a larger run. The last page is scratch: the padded
rows of a batch bucket write their K/V there and attend to it alone. `release` gives a run back
when the request ends. Not thread-safe: the scheduler's thread is its only user.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ragkv.engine.kv.cache import KVCache

PAGE_TOKENS = 16  # slots per page: runs are whole pages


@dataclass(slots=True, eq=False)  # one run is one object: held in sets by identity
class Run:
    """One request's slots: [start, start + size)."""

    start: int
    size: int


class DecodePoolFullError(RuntimeError):
    """The pool has no run of the size asked for (the caller decodes that request outside it)."""


class DecodePool:
    """K and V slots `[L, Hkv, S, D]` on one device; each decoding request holds one run of them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str, page_tokens: int = PAGE_TOKENS) -> None:
        if capacity_tokens < 2 * page_tokens:
            raise ValueError(f"a decode pool needs at least 2 pages of {page_tokens} tokens, got {capacity_tokens} tokens")
        self.page_tokens = page_tokens
        pages = capacity_tokens // page_tokens
        slots = pages * page_tokens
        self.k = torch.zeros(num_layers, num_kv_heads, slots, head_dim, dtype=dtype, device=device)  # [L, Hkv, S, D]
        self.v = torch.zeros_like(self.k)  # [L, Hkv, S, D]
        self.scratch = slots - page_tokens  # the last page: padded rows write and read here
        self._free: list[Run] = [Run(0, self.scratch)]  # by start, adjacent runs merged
        self._held: dict[Run, weakref.finalize[[Run], KVCache]] = {}  # each run held -> what frees it if its cache is dropped
        self._dropped: list[Run] = []  # runs of caches dropped unreleased (any thread): back at the next take
        self.copied_tokens = 0  # tokens' KV copied in by admit and moves (a lease or insert would add none)
        self.moves = 0  # runs that had to move to grow

    @property
    def capacity(self) -> int:
        """Token slots for requests (the scratch page not counted)."""
        return self.scratch

    @property
    def used(self) -> int:
        """Token slots held by runs (a dropped cache's until the next take)."""
        return sum(r.size for r in self._held)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def run_of(self, cache: KVCache) -> Run | None:
        """The run `cache` holds, or None when it is not in the pool."""
        run = cache.run
        return run if cache.pool is self and isinstance(run, Run) else None

    def new_cache(self, capacity: int) -> KVCache | None:
        """An empty cache of `capacity` tokens in a run of the pool, or None when no run is that
        large (the caller makes one of its own). A cache dropped without `release` (a pass that
        failed or was cancelled before it decoded) gives its run back when it is collected."""
        try:
            run = self._take(capacity)
        except DecodePoolFullError:
            return None
        cache = KVCache.over(self.k[:, :, run.start:run.start + run.size], self.v[:, :, run.start:run.start + run.size])
        self._own(cache, run)
        return cache

    def admit(self, cache: KVCache, room: int) -> None:
        """Move `cache` into a run with room for `room` tokens (at least its length), copying its
        valid KV once; its k and v become views of the pool. A cache already here is grown to `room`.

        Raises:
            DecodePoolFullError: no free run is that large.
            ValueError: the cache's shape or dtype is not the pool's.
        """
        if self.run_of(cache) is not None:
            self.grow(cache, room)
            return
        L, H, _, D = cache.k.shape
        if (L, H, D) != (self.k.shape[0], self.k.shape[1], self.k.shape[3]) or cache.k.dtype != self.k.dtype:
            raise ValueError(f"a cache of [L={L}, Hkv={H}, D={D}] {cache.k.dtype} cannot enter a decode pool of "
                             f"{tuple(self.k.shape)} {self.k.dtype}")
        run = self._take(max(room, cache.length))
        n = cache.length
        self.k[:, :, run.start:run.start + n] = cache.k[:, :, :n]
        self.v[:, :, run.start:run.start + n] = cache.v[:, :, :n]
        self.copied_tokens += n
        self._own(cache, run)
        self._point(cache, run)

    def _own(self, cache: KVCache, run: Run) -> None:
        self._held[run] = weakref.finalize(cache, self._dropped.append, run)
        cache.pool, cache.run = self, run

    def grow(self, cache: KVCache, tokens: int) -> None:
        """Give `cache`'s run room for `tokens` tokens: the free pages right after it, else a move."""
        run = self.run_of(cache)
        if run is None:
            raise RuntimeError("DecodePool.grow of a cache not in the pool: a bug")
        if tokens <= run.size:
            return
        need = self._pages(tokens)
        after = next((f for f in self._free if f.start == run.start + run.size), None)
        if after is not None and run.size + after.size >= need:
            extra = need - run.size
            after.start, after.size = after.start + extra, after.size - extra
            if after.size == 0:
                self._free.remove(after)
            run.size = need
            self._point(cache, run)
            return
        new = self._take(max(tokens, 2 * run.size))  # doubling, as a cache of its own would
        n = cache.length
        self.k[:, :, new.start:new.start + n] = self.k[:, :, run.start:run.start + n]
        self.v[:, :, new.start:new.start + n] = self.v[:, :, run.start:run.start + n]
        self.copied_tokens += n
        self.moves += 1
        self._held.pop(run).detach()
        self._give(run)
        self._own(cache, new)
        self._point(cache, new)

    def release(self, cache: KVCache) -> None:
        """The request ended: its run goes back. Its cache keeps a copy of its KV (a caller may still
        read it, e.g. a late insert into the KV tree), and is no longer the pool's."""
        run = self.run_of(cache)
        if run is None:
            return
        self._held.pop(run).detach()
        n = cache.length
        cache.k, cache.v = cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()  # [L, Hkv, n, D]
        cache.pool, cache.run = None, None
        self._give(run)

    def _point(self, cache: KVCache, run: Run) -> None:
        cache.k = self.k[:, :, run.start:run.start + run.size]  # [L, Hkv, size, D], a view
        cache.v = self.v[:, :, run.start:run.start + run.size]

    def _pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages."""
        p = self.page_tokens
        return -(-tokens // p) * p

    def _take(self, tokens: int) -> Run:
        while self._dropped:  # caches collected unreleased: their runs come back first
            run = self._dropped.pop()
            if self._held.pop(run, None) is not None:
                self._give(run)
        size = self._pages(max(tokens, 1))
        for f in self._free:  # first fit
            if f.size >= size:
                run = Run(f.start, size)
                f.start, f.size = f.start + size, f.size - size
                if f.size == 0:
                    self._free.remove(f)
                return run
        raise DecodePoolFullError(f"the decode pool has no run of {size} free tokens "
                                  f"({self.used} of {self.capacity} held)")

    def _give(self, run: Run) -> None:
        """A run back into the free list, merged with its free neighbours."""
        self._free.append(Run(run.start, run.size))
        self._free.sort(key=lambda f: f.start)
        merged: list[Run] = []
        for f in self._free:
            if merged and merged[-1].start + merged[-1].size == f.start:
                merged[-1].size += f.size
            else:
                merged.append(f)
        self._free = merged
