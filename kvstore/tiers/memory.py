"""Memory tiers: CpuTier (host memory, pinned when CUDA is there) and GpuTier (CUDA memory).

They hold ready-to-use KVEntry objects in the entry's own dtype (the store's file
compression does not apply here) under a byte budget, evicting by policy. Entries
are returned without a copy: callers must not modify their tensors in place. In a cluster
the host tier holds what it has published to the peer tier in the object store's shared
memory, not a second copy of its own (`MemoryTier.share`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from ragkv.errors import StoreError
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.eviction import EvictionTracker, Policy
from ragkv.kvstore.keys import ChunkKey
from ragkv.kvstore.tiers.base import Hit, StorageTier, Tier

logger = logging.getLogger(__name__)


class MemoryTier(StorageTier):
    """Entries held in a dict on one device, under a byte budget."""

    def __init__(
        self,
        tier: Tier,
        device: torch.device,
        model_fp: str,
        tokenizer_fp: str,
        budget_bytes: int | None = None,
        policy: Policy = Policy.LRU,
        pin: bool = False,
    ) -> None:
        super().__init__(model_fp, tokenizer_fp, budget_bytes)
        self.tier = tier
        self.device = device
        self.pin = pin
        self._lock = threading.Lock()
        self._entries: dict[ChunkKey, KVEntry] = {}
        self._bytes = 0
        self._shared: set[ChunkKey] = set()  # entries whose tensors view shared memory (`share`)
        self._leaving: list[Callable[[list[ChunkKey]], object]] = []  # told of keys evicted or deleted
        self._tracker: EvictionTracker[ChunkKey] = EvictionTracker(policy)

    @property
    def policy(self) -> Policy:
        """The eviction policy."""
        return self._tracker.policy

    def _placed(self, entry: KVEntry, copy: bool) -> KVEntry:
        """`entry` with k and v on this tier's device (pinned if asked).

        No copy if already there, unless `copy`: then the tier gets memory of its own
        (an entry read from disk views the file's map, which would keep an evicted
        file's space allocated for as long as the entry stayed here).
        """
        k, v = entry.k, entry.v
        if k.device != self.device:
            # Asynchronous only towards CUDA, where the stream orders later use.
            async_copy = self.device.type == "cuda"
            k = k.to(self.device, non_blocking=async_copy)  # [L, Hkv, T, D]
            v = v.to(self.device, non_blocking=async_copy)  # [L, Hkv, T, D]
        if self.pin and not k.is_pinned():
            k, v = k.pin_memory(), v.pin_memory()
        if k is entry.k and v is entry.v:
            if not copy:
                return entry
            k, v = k.clone(), v.clone()
        if copy:
            return dataclasses.replace(
                entry, k=k, v=v, token_ids=entry.token_ids.clone(), positions=entry.positions.clone()
            )
        return dataclasses.replace(entry, k=k, v=v)

    def get(self, key: ChunkKey) -> KVEntry | None:
        started = time.perf_counter()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._tracker.touch(key)
        self._counters.got(started, None if entry is None else entry.nbytes)
        return entry

    def put(self, entry: KVEntry) -> bool:
        return self.admit(entry) is not None

    def take(self, hit: Hit) -> KVEntry | None:
        """Hold a hit from below: a copy of one read from a file (its tensors view the file's bytes)."""
        return self.admit(hit.entry, copy=hit.data is not None)

    def admit(self, entry: KVEntry, copy: bool = False) -> KVEntry | None:
        """Like `put`, returning the entry as held here (on this tier's device), or None if refused.

        Args:
            entry: what to hold.
            copy: hold a copy even where the tensors could be kept as they are (see `_placed`).
        """
        self._check_entry(entry)
        started = time.perf_counter()
        size = entry.nbytes
        if self.budget_bytes is not None and size > self.budget_bytes:
            self._counters.add(refused=1)
            return None
        with self._lock:
            held = self._entries.get(entry.key)
            if held is not None:
                self._tracker.touch(entry.key)
        if held is not None:
            self._counters.add(put_seconds=time.perf_counter() - started)
            return held
        placed = self._placed(entry, copy)  # copies outside the lock
        evicted: list[ChunkKey] = []
        with self._lock:
            if entry.key in self._entries:  # another thread won the race
                placed = self._entries[entry.key]
                size = 0
            else:
                while self.budget_bytes is not None and self._bytes + size > self.budget_bytes:
                    victim = self._tracker.victim()
                    if victim is None:
                        raise RuntimeError(f"bug: {self._bytes} bytes held but no key to evict")
                    self._drop(victim)
                    evicted.append(victim)
                self._entries[entry.key] = placed
                self._bytes += size
                self._tracker.add(entry.key)
        self._counters.add(
            puts=1 if size else 0, bytes_written=size, evictions=len(evicted),
            put_seconds=time.perf_counter() - started,
        )
        self._left(evicted)
        return placed

    def on_leaving(self, listener: Callable[[list[ChunkKey]], object]) -> None:
        """Call `listener` with the keys that leave this tier (evicted or deleted), on the thread
        that made them leave, after the fact: it must be quick (the peer tier queues a withdrawal)."""
        self._leaving.append(listener)

    def _left(self, keys: list[ChunkKey]) -> None:
        if keys:
            for listener in self._leaving:
                listener(keys)

    def _drop(self, key: ChunkKey) -> None:
        """Remove `key` (lock held)."""
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._tracker.remove(key)
        self._shared.discard(key)

    def can_share(self, key: ChunkKey) -> bool:
        """Whether `share` would take a shared copy of `key` now: held here in its own memory, on
        the host and not pinned (pinned memory is what a GPU host copies from; shared memory is not)."""
        with self._lock:
            return self.device.type == "cpu" and not self.pin and key in self._entries and key not in self._shared

    def share(self, key: ChunkKey, decode: Callable[[], KVEntry]) -> bool:
        """Hold `key`'s KV in memory shared with other processes (its published copy in the
        cluster's object store, `kvstore.tiers.peer`) instead of this tier's own, which goes.

        `decode()` gives the entry whose tensors view that memory; it must equal the entry held
        (the same file's bytes). The tier's budget still counts the entry: it is this host's
        memory either way, now held once. False (nothing changes) when `key` is not held here,
        or is shared already, or `can_share` says no, or the shared copy does not match.
        """
        if not self.can_share(key):
            return False
        shared = decode()  # outside the lock: parses and verifies the file
        with self._lock:
            held = self._entries.get(key)
            if held is None or key in self._shared:
                return False
            if (shared.k.shape, shared.v.shape, shared.k.dtype) != (held.k.shape, held.v.shape, held.k.dtype) \
                    or shared.k.device != held.k.device:
                logger.warning("the shared copy of %s is %s %s, the held one %s %s: keeping the held one",
                               key.hex, shared.k.dtype, tuple(shared.k.shape), held.k.dtype, tuple(held.k.shape))
                return False
            self._entries[key] = shared
            self._shared.add(key)
        return True

    @property
    def shared_bytes(self) -> int:
        """Bytes of the entries held in shared memory (`share`), within `bytes_used`."""
        with self._lock:
            return sum(self._entries[k].nbytes for k in self._shared)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._drop(key)
        self._left([key])
        return True

    def keys_by_eviction_order(self) -> list[ChunkKey]:
        """Held keys, least recently used first (eviction order under LRU)."""
        with self._lock:
            return self._tracker.keys_oldest_first()

    def held_keys(self) -> list[ChunkKey]:
        return self.keys_by_eviction_order()

    def _usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes


class CpuTier(MemoryTier):
    """Host memory; tensors pinned when CUDA is available, so copies to the GPU can overlap."""

    def __init__(
        self,
        model_fp: str,
        tokenizer_fp: str,
        budget_bytes: int | None = None,
        policy: Policy = Policy.LRU,
    ) -> None:
        super().__init__(
            Tier.CPU, torch.device("cpu"), model_fp, tokenizer_fp, budget_bytes, policy,
            pin=torch.cuda.is_available(),
        )


class GpuTier(MemoryTier):
    """CUDA memory. Raises StoreError when CUDA is not available."""

    def __init__(
        self,
        model_fp: str,
        tokenizer_fp: str,
        budget_bytes: int | None = None,
        policy: Policy = Policy.LRU,
        device: str = "cuda",
    ) -> None:
        if not torch.cuda.is_available():
            raise StoreError(f"gpu tier on {device!r} needs CUDA; torch.cuda.is_available() is False")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"gpu tier device must be a CUDA device, got {device!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(Tier.GPU, dev, model_fp, tokenizer_fp, budget_bytes, policy)
