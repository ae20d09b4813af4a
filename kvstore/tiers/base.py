"""The interface every tier offers, and the counters behind `stats()`.

A tier stores KVEntry values under ChunkKeys for one (model, tokenizer) pair. Its
`get` returns None on a miss, and also when what it holds is damaged or belongs to
another model: that is counted as `rejected`, logged, and the bad copy is
quarantined or removed. Caller mistakes raise ValueError/TypeError; a tier that
cannot do its job (a put to a dead S3 endpoint) raises StoreError.

Knows nothing of the other tiers or of promotion: that is TieredStore's job.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ragkv.kvstore.compression import Compression, DequantClock
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.keys import ChunkKey, check_fingerprint
from ragkv.kvstore.layered import LayerGate
from ragkv.types import Tier as Tier  # re-exported: the one tier enum
from ragkv.types import TierStats as TierStats  # re-exported: the one TierStats

Spawn = Callable[[Callable[[], None]], object]  # runs the rest of a layer-wise read (a thread pool's submit)


@dataclass(frozen=True, slots=True)
class Hit:
    """A read that found its key: the one hit of kvstore, from a tier or from the store."""

    entry: KVEntry  # the KV (as held by the topmost tier it now sits in, once the store promoted it)
    tier: Tier  # the tier it was found in
    seconds: float = 0.0  # the store's wall time of the lookup, promotion included
    # layer-wise reads: wait on this before reading a layer of entry.k / entry.v; None = all filled
    layers: LayerGate | None = None
    data: memoryview | bytearray | None = None  # a durable tier's verified file bytes (a disk above copies them)
    stored_bytes: int = 0  # a durable tier's file size as stored (compressed or not); 0 = a memory tier's entry
    # a compressed file's dequantization time (complete once the layers are: `layers`); None = none ran
    dequant: DequantClock | None = None


class _Counters:
    """Mutable counters behind TierStats; every update under one lock."""

    __slots__ = (
        "lock", "hits", "misses", "rejected", "errors", "puts", "refused", "evictions",
        "bytes_read", "bytes_written", "get_seconds", "put_seconds", "max_get_seconds",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = self.misses = self.rejected = self.errors = 0
        self.puts = self.refused = self.evictions = 0
        self.bytes_read = self.bytes_written = 0
        self.get_seconds = self.put_seconds = self.max_get_seconds = 0.0

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def got(self, started: float, nbytes: int | None) -> None:
        """Record one get that began at `started` (perf_counter); nbytes None is a miss."""
        dt = time.perf_counter() - started
        with self.lock:
            if nbytes is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_read += nbytes
            self.get_seconds += dt
            self.max_get_seconds = max(self.max_get_seconds, dt)


class StorageTier(abc.ABC):
    """One tier: get, put, contains, delete, their batched forms, and stats."""

    tier: Tier
    # True for a tier that holds a copy of every hit whatever tier gave it (the peer tier publishes
    # what a disk above it gave too); others take only hits from tiers below them (promotion)
    takes_every_hit = False
    # whether a hit from this tier is copied into the tiers above it (promotion); the peer tier's
    # are read through by default: a copy on every replica would shrink what the pool holds
    hits_kept_above = True

    @property
    def kind(self) -> str:
        """Its kind's name in `kvstore.tiers.kinds` (a built-in kind is named as the tier it reports)."""
        return self.tier.value

    def __init__(self, model_fp: str, tokenizer_fp: str, budget_bytes: int | None) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be a non-negative int or None, got {budget_bytes!r}")
        self.model_fp = check_fingerprint(model_fp, "model fingerprint")
        self.tokenizer_fp = check_fingerprint(tokenizer_fp, "tokenizer fingerprint")
        self.budget_bytes = budget_bytes
        self._counters = _Counters()

    @abc.abstractmethod
    def get(self, key: ChunkKey) -> KVEntry | None:
        """The entry under `key`, or None (missing, damaged, or another model's)."""

    @abc.abstractmethod
    def put(self, entry: KVEntry) -> bool:
        """Store `entry`; False if it cannot fit the byte budget at all (nothing else is dropped then)."""

    @abc.abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether a copy is there (not verified: a later get may still reject it)."""

    @abc.abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove `key`'s copy; True if there was one."""

    @abc.abstractmethod
    def _usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""

    def read(self, key: ChunkKey, layered: bool = False, spawn: Spawn | None = None,
             on_done: Callable[[Hit], object] | None = None) -> Hit | None:
        """Read `key` for the store; None on a miss (or a rejected copy).

        A tier that can hand a read out before it is whole does so when `layered` (and
        `spawn` is given): the hit's `layers` gate says how far its KV is filled, `spawn`
        runs the rest, and `on_done(hit)` is called with the whole, verified read. Others
        read whole, and their hit has no gate.
        """
        entry = self.get(key)
        return None if entry is None else Hit(entry, self.tier)

    def take(self, hit: Hit) -> KVEntry | None:
        """Hold a copy of a hit found in a tier below (the store's promotion); the entry as
        held here when the caller should read that one (a memory tier's), else None."""
        self.put(hit.entry)
        return None

    def write(self, entry: KVEntry, encoded: dict[object, bytes], compression: Compression | None = None) -> bool:
        """`put`, sharing encodings with the other tiers of one store put (`encoded`: by
        compression); a durable tier encodes with `compression` when given, else its own."""
        return self.put(entry)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key (a tier that can ask for many at once, the peer tier's
        directory, does so in one call)."""
        return [self.contains(k) for k in keys]

    def held_keys(self) -> list[ChunkKey] | None:
        """The keys this tier holds, for a cluster's router; None: a tier shared by every host
        (S3), whose holdings say nothing about this one. Local tiers list their index."""
        return None

    def get_many(self, keys: Sequence[ChunkKey]) -> list[KVEntry | None]:
        """`get` for each key, in order."""
        return [self.get(k) for k in keys]

    def put_many(self, entries: Iterable[KVEntry]) -> list[bool]:
        """`put` for each entry, in order."""
        return [self.put(e) for e in entries]

    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""
        entries, used = self._usage()
        c = self._counters
        with c.lock:
            return TierStats(
                tier=self.tier, hits=c.hits, misses=c.misses, rejected=c.rejected, errors=c.errors,
                puts=c.puts, refused=c.refused, evictions=c.evictions, bytes_read=c.bytes_read,
                bytes_written=c.bytes_written, entries=entries, bytes_used=used,
                budget_bytes=self.budget_bytes, get_seconds=c.get_seconds,
                put_seconds=c.put_seconds, max_get_seconds=c.max_get_seconds,
            )

    def close(self) -> None:  # noqa: B027 - optional to override: most tiers hold nothing open
        """Release what the tier holds open (nothing by default)."""

    def joined(self, tiers: Sequence[StorageTier]) -> None:  # noqa: B027 - optional: most tiers need no other
        """Called when this tier is attached to a running store (`TieredStore.attach`) with the
        store's tiers, itself among them: the peer tier shares its objects' memory with the host
        tier. Nothing by default."""

    def _check_entry(self, entry: KVEntry) -> None:
        """Refuse an entry of another model or tokenizer: a store serves one pair."""
        if not isinstance(entry, KVEntry):
            raise TypeError(f"put needs a KVEntry, got {type(entry).__name__}")
        if entry.model_fp != self.model_fp or entry.tokenizer_fp != self.tokenizer_fp:
            raise ValueError(
                f"entry {entry.key.hex} is for model {entry.model_fp!r} / tokenizer "
                f"{entry.tokenizer_fp!r}; this {self.tier.value} tier serves "
                f"{self.model_fp!r} / {self.tokenizer_fp!r}"
            )
