"""One tier's KV for every node of the KV tree: token slots in one pair of tensors, handed out
by index (SGLang's token-to-KV pool under its radix cache, arXiv 2312.07104).

A node holds the indices of its tokens' slots, not tensors of its own, so a split cuts an
index list and copies no KV, and a node leaving the tier gives its slots back for the next.
The indices live on the host whatever the pool's device: reading one (is a node's run of slots
contiguous?) never waits for the device.
The pool takes its shape, dtype and device from the first KV written to it, and grows by
half again as nodes come, never past the tier's budget. `compact` moves the held slots to
the front and gives the rest of the memory back (admission taking the tree's bytes for
requests): the tree then renumbers its nodes' slots by the map it returns.

Not thread-safe: the tree calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ragkv.engine.kv.cache import KVCache

GROW = 1.5  # capacity grows by this factor (at least to what a write needs)
MIN_TOKENS = 256  # the smallest capacity the pool takes


class KVPool:
    """K and V token slots `[L, Hkv, S, D]` on one device, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, device: torch.device | str | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.device = None if device is None else torch.device(device)  # None: the first write's
        self.k: torch.Tensor | None = None  # [L, Hkv, S, D], after RoPE
        self.v: torch.Tensor | None = None  # [L, Hkv, S, Dv]
        self._free = torch.empty(0, dtype=torch.long)  # [F] free slot indices, ascending (CPU)
        self._given: list[torch.Tensor] = []  # slots given back since, merged into `_free` when next needed
        self.gathered_tokens = 0  # tokens' KV gathered into new tensors (`get`, `copy_into` of scattered slots)
        self.written_tokens = 0  # tokens' KV copied in (`put`)
        self.read_tokens = 0  # tokens' KV copied out (`get`, `copy_into`)

    @property
    def capacity(self) -> int:
        """Token slots allocated."""
        return 0 if self.k is None else self.k.shape[2]

    @property
    def used(self) -> int:
        """Token slots held by nodes."""
        return self.capacity - len(self._free) - sum(len(s) for s in self._given)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V (0 before the first write)."""
        if self.k is None or self.v is None:
            return 0
        L, H, _, D = self.k.shape
        return L * (H * D * self.k.element_size() + self.v.shape[1] * self.v.shape[3] * self.v.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of memory the pool's tensors take (held slots and free ones)."""
        return self.capacity * self.token_bytes

    def put(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Copy `k`, `v` ([L, Hkv, T, D]) into T free slots; returns their indices ([T] int64, on
        the host). Raises MemoryError when the budget cannot hold T more tokens (the
        tree makes room first, so that is a bug), ValueError when the KV's shape is not the pool's."""
        self._shape_check(k, v)
        self._merge()
        n = k.shape[2]
        if n > len(self._free):
            self._grow(self.used + n)
        assert self.k is not None and self.v is not None
        slots = self._free[:n]  # [T] (CPU)
        self._free = self._free[n:]
        self.written_tokens += n
        at = slots.to(self.k.device, non_blocking=True)
        self.k.index_copy_(2, at, k.to(self.k.device, self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.device, self.v.dtype))
        return slots

    def get(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V held in `slots` ([T], on the host): [L, Hkv, T, D] each."""
        if self.k is None or self.v is None:
            raise RuntimeError("KVPool.get before any put: a bug")
        self.gathered_tokens += len(slots)
        self.read_tokens += len(slots)
        at = slots.to(self.k.device, non_blocking=True)
        return self.k.index_select(2, at), self.v.index_select(2, at)

    def copy_into(self, slots: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Write the K and V held in `slots` ([T], ascending, as a node holds them) into `k_out` and
        `v_out` ([L, Hkv, T, D], e.g. a request's cache at the node's positions): one copy, straight
        from the pool's tensors when the slots are one run (as `put` hands them out from a free
        list that is not fragmented), else through a gather. The slots are on the host, so telling
        which never waits for the device."""
        if self.k is None or self.v is None:
            raise RuntimeError("KVPool.copy_into before any put: a bug")
        n = len(slots)
        if n == 0:
            return
        first, last = int(slots[0]), int(slots[-1])
        if last - first + 1 == n:  # ascending and distinct: exactly the run [first, last]
            self.read_tokens += n
            k_out.copy_(self.k[:, :, first:last + 1])
            v_out.copy_(self.v[:, :, first:last + 1])
            return
        k, v = self.get(slots)
        k_out.copy_(k)
        v_out.copy_(v)

    def adopt(self, cache: KVCache, start: int, stop: int, let_go: Callable[[], None]) -> torch.Tensor | None:
        """Slots that already hold positions [start, stop) of a request's `cache`, now the
        pool's, with no copy (`let_go` is called once the request no longer reads them); None
        here (a pool of its own copies them in: `put`). The decode pool's share does take them
        (`engine.kv.decode_pool.SharedSlots`)."""
        return None

    def release(self, slots: torch.Tensor) -> None:
        """Give `slots` back; their KV may be overwritten by the next `put`. (An eviction gives
        back many nodes' slots in a row: they are merged into the free list once, at the next
        `put` or `compact`.)"""
        if len(slots):
            self._given.append(slots)

    def _merge(self) -> None:
        """The slots given back, into the free list (ascending: a node's slots stay near each other)."""
        if self._given:
            self._free = torch.sort(torch.cat([self._free, *self._given])).values
            self._given.clear()

    def compact(self, capacity_bytes: int) -> torch.Tensor | None:
        """Shrink the tensors to at most `capacity_bytes` (never below the held slots) by moving
        the held slots to the front; returns the map old slot -> new slot ([S_old] int64 on the
        host, -1 for a free slot) that the holders' indices go through, or None when nothing moved."""
        if self.k is None or self.v is None:
            return None
        self._merge()
        keep = max(self.used, capacity_bytes // max(self.token_bytes, 1))
        if keep >= self.capacity:
            return None
        held = torch.ones(self.capacity, dtype=torch.bool)
        held[self._free] = False
        old = torch.nonzero(held).flatten()  # [used] the held slots, ascending
        remap = torch.full((self.capacity,), -1, dtype=torch.long)
        remap[old] = torch.arange(len(old))
        moved = old.to(self.k.device)
        k, v = self._empty(keep)
        k[:, :, :len(old)] = self.k.index_select(2, moved)
        v[:, :, :len(old)] = self.v.index_select(2, moved)
        self.k, self.v = k, v
        self._free = torch.arange(len(old), keep)
        return remap

    def _grow(self, tokens: int) -> None:
        """Reallocate for at least `tokens` slots: half again the capacity, within the budget."""
        limit = self.budget_bytes // max(self.token_bytes, 1)
        if tokens > limit:
            raise MemoryError(f"the KV tree's pool cannot hold {tokens} tokens in its {self.budget_bytes} bytes: a bug")
        size = min(limit, max(tokens, int(self.capacity * GROW), MIN_TOKENS))
        k, v = self._empty(size)
        assert self.k is not None and self.v is not None
        k[:, :, :self.capacity] = self.k
        v[:, :, :self.capacity] = self.v
        self._free = torch.cat([self._free, torch.arange(self.capacity, size)])
        self.k, self.v = k, v

    def _empty(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New K and V tensors of `tokens` slots: plain tensors even when made under inference
        mode (a prompt pass making room), so writes from any thread can go on updating them."""
        assert self.k is not None and self.v is not None
        L, H, _, D = self.k.shape
        with torch.inference_mode(False):
            k = torch.empty(L, H, tokens, D, dtype=self.k.dtype, device=self.k.device)  # [L, Hkv, S, D]
            v = torch.empty(L, self.v.shape[1], tokens, self.v.shape[3], dtype=self.v.dtype, device=self.v.device)
        return k, v

    def _shape_check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take the first write's shape, dtype and device; refuse another shape after it."""
        if self.k is None:
            device = self.device or k.device
            with torch.inference_mode(False):  # see `_empty`
                self.k = torch.empty(k.shape[0], k.shape[1], 0, k.shape[3], dtype=k.dtype, device=device)
                self.v = torch.empty(v.shape[0], v.shape[1], 0, v.shape[3], dtype=v.dtype, device=device)
            return
        assert self.v is not None
        if (k.shape[:2], k.shape[3], v.shape[:2], v.shape[3]) != (self.k.shape[:2], self.k.shape[3],
                                                                   self.v.shape[:2], self.v.shape[3]):
            raise ValueError(f"the KV tree holds KV of shape {tuple(self.k.shape)}, not {tuple(k.shape)}: "
                             "one tree serves one model")
