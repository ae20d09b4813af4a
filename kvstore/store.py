"""TieredStore: one store over the tiers, looked at top-down (GPU, CPU, disk, S3).

One read API: `prefetch(keys, layered=False)` starts loading in background threads and
returns one `PrefetchHandle` per key (its `future`, `done()`, `hit(timeout)`);
concurrent prefetches of one key share one load. `read(key, layered=False)` is the
same lookup on the caller's thread. Either way:
- a read gives the one `Hit` (entry, the tier it was found in, seconds) or None, and a
  hit is promoted into every tier above the one that held it (`StorageTier.take`:
  memory tiers hold the entry, a disk above S3 the verified file bytes);
- `layered=True` hands a durable tier's hit out as soon as its header is verified:
  `Hit.layers` says how many of the entry's layers are filled and verified so far
  (kvstore.layered), so compute on layer l overlaps the read of layer l+1. The hit is
  promoted once the whole file has passed.
`put(entry)` is inclusive: the entry goes into every memory tier (each under its budget)
and is written through to the durable tiers the config names (`StorageTier.write`).

The store asks each tier only what `StorageTier` says (`read`, `take`, `write`,
`contains`, `delete`, `stats`); whether a tier is durable is its `Tier`'s.

A store serves one (model_fp, tokenizer_fp) pair: a file of another model is a miss,
and putting another model's entry is a ValueError. All methods are thread-safe.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ragkv.errors import StoreError
from ragkv.kvstore.compression import Compression
from ragkv.kvstore.config import StoreConfig, TierSpec
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.keys import ChunkKey, check_fingerprint
from ragkv.kvstore.layered import LayerGate
from ragkv.kvstore.tiers import kinds as tier_kinds
from ragkv.kvstore.tiers.base import Hit, StorageTier, Tier, TierStats
from ragkv.kvstore.tiers.durable import DurableTier
from ragkv.kvstore.timing import ReadEstimate, ReadTiming

logger = logging.getLogger(__name__)

_STREAM_WORKERS = 16  # concurrent layered reads (a prompt has 3-10 chunks)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a store's counters."""

    tiers: tuple[TierStats, ...]  # per tier, top-down
    lookups: int  # read/prefetch lookups
    misses: int  # lookups that missed every tier
    promotions: int  # copies made into upper tiers on hits
    promotion_failures: int  # promotions that failed (logged; the hit still returned)
    prefetches: int  # keys passed to prefetch
    prefetch_joined: int  # prefetched keys that joined a load already in flight

    def tier(self, tier: Tier) -> TierStats:
        """The stats of one tier; KeyError if the store has no such tier."""
        for s in self.tiers:
            if s.tier is tier:
                return s
        raise KeyError(f"store has no {tier.value} tier")


class PrefetchHandle:
    """A key being loaded in the background."""

    __slots__ = ("key", "_future")

    def __init__(self, key: ChunkKey, future: Future[Hit | None]) -> None:
        self.key = key  # the key being loaded
        self._future = future

    def hit(self, timeout: float | None = None) -> Hit | None:
        """Wait for the load; the Hit, or None on a miss.

        Raises:
            concurrent.futures.TimeoutError: not done within `timeout` seconds.
        """
        return self._future.result(timeout)

    @property
    def future(self) -> Future[Hit | None]:
        """The load itself: done once `hit` returns without waiting (a scheduler parks on it)."""
        return self._future

    def done(self) -> bool:
        """Whether the load has finished."""
        return self._future.done()


def build_tier(
    spec: TierSpec, config: StoreConfig, model_fp: str, tokenizer_fp: str
) -> StorageTier:
    """The tier object a spec describes (its kind's builder, `kvstore.tiers.kinds`)."""
    build = spec.tier_kind.build
    if build is None:
        raise RuntimeError(f"bug: TierSpec {spec!r} passed its checks but names a kind with no builder")
    return build(spec, config, model_fp, tokenizer_fp)


def _rank(t: StorageTier) -> int:
    return tier_kinds.kind(t.kind).rank


def _durable(t: StorageTier) -> bool:
    return tier_kinds.kind(t.kind).durable


class TieredStore:
    """The tiers of one store, for one (model, tokenizer) pair."""

    def __init__(self, config: StoreConfig, model_fp: str, tokenizer_fp: str) -> None:
        """Build the tiers `config` names for one (model, tokenizer) pair.

        Raises:
            ValueError: a fingerprint that is not one safe path segment.
            StoreError: a tier that cannot be opened (no CUDA for gpu, unwritable disk root).
        """
        check_fingerprint(model_fp, "model fingerprint")
        check_fingerprint(tokenizer_fp, "tokenizer fingerprint")
        built: list[StorageTier] = []
        try:
            for spec in config.tiers:
                built.append(build_tier(spec, config, model_fp, tokenizer_fp))
        except BaseException:
            for t in built:
                t.close()
            raise
        self._setup(built, config.durable_writes, config.prefetch_workers)
        self.dequantize_on(torch.device(config.device))

    def dequantize_on(self, device: torch.device) -> None:
        """Where layered reads of compressed files dequantize their layers and leave them (the
        engine's device: the packed bytes cross to it, not the dequantized ones)."""
        for t in self._tiers:
            if isinstance(t, DurableTier):
                t.dequant_device = device

    @classmethod
    def from_tiers(
        cls,
        tiers: Sequence[StorageTier],
        *,
        write_through: Iterable[Tier] | None = None,
        prefetch_workers: int = 4,
    ) -> TieredStore:
        """Compose already-built tiers (tests, custom tiers).

        Args:
            tiers: one per kind, any order (they are looked at GPU, CPU, disk, S3).
            write_through: durable tiers a put writes to; None = all durable tiers given.
            prefetch_workers: threads for prefetch.
        """
        store = cls.__new__(cls)
        store._setup(tiers, write_through, prefetch_workers)
        return store

    def _setup(
        self, tiers: Sequence[StorageTier], write_through: Iterable[Tier] | None, prefetch_workers: int
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self._tiers = tuple(sorted(tiers, key=_rank))
        self._timing = {t.tier: ReadTiming() for t in self._tiers}  # measured read speed per tier
        kinds = [t.tier for t in self._tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"each tier may appear once, got {[k.value for k in kinds]}")
        fps = {(t.model_fp, t.tokenizer_fp) for t in self._tiers}
        if len(fps) != 1:
            raise ValueError(f"tiers serve different (model, tokenizer) pairs: {sorted(fps)}")
        self.model_fp, self.tokenizer_fp = fps.pop()
        durable = {t.tier for t in self._tiers if _durable(t)}
        wt = durable if write_through is None else {Tier(t) for t in write_through}
        if not wt <= durable:
            raise ValueError(
                f"write_through {sorted(t.value for t in wt)} must be durable tiers of this store "
                f"({sorted(t.value for t in durable)})"
            )
        if prefetch_workers < 1:
            raise ValueError(f"prefetch_workers must be >= 1, got {prefetch_workers}")
        self.write_through = frozenset(wt)
        self._pool = ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="kvstore-prefetch")
        self.prefetch_workers = prefetch_workers  # reads in flight at once
        # the bodies of layered reads: one per chunk in flight, so a prompt's chunks fill side by side
        self._stream_pool = ThreadPoolExecutor(max_workers=max(_STREAM_WORKERS, prefetch_workers),
                                               thread_name_prefix="kvstore-layers")
        self._lock = threading.RLock()
        self._inflight: dict[tuple[ChunkKey, bool], Future[Hit | None]] = {}
        self._lookups = self._misses = self._promotions = self._promotion_failures = 0
        self._prefetches = self._prefetch_joined = 0

    @property
    def tiers(self) -> tuple[StorageTier, ...]:
        """The tiers, top-down."""
        return self._tiers

    @property
    def compression(self) -> Compression:
        """How this store's files are compressed (its first durable tier's; NONE without one)."""
        return next((t.compression for t in self._tiers if isinstance(t, DurableTier)), Compression.NONE)

    def attach(self, tier: StorageTier) -> None:
        """Add a tier built elsewhere to a running store, in its place in the lookup order (a
        cluster replica's peer tier, `kvstore.tiers.peer`). It must serve this store's model."""
        if (tier.model_fp, tier.tokenizer_fp) != (self.model_fp, self.tokenizer_fp):
            raise ValueError(f"a {tier.tier.value} tier for model {tier.model_fp!r} cannot join a store of "
                             f"{self.model_fp!r}")
        if _durable(tier):
            raise ValueError(f"attach takes a tier that is not written through; {tier.tier.value} is")
        with self._lock:
            if any(t.tier is tier.tier for t in self._tiers):
                raise ValueError(f"this store has a {tier.tier.value} tier already")
            self._timing[tier.tier] = ReadTiming()
            self._tiers = tuple(sorted((*self._tiers, tier), key=_rank))
        tier.joined(self._tiers)

    def tier(self, tier: Tier) -> StorageTier:
        """One tier by kind; KeyError if the store has none."""
        for t in self._tiers:
            if t.tier is tier:
                return t
        raise KeyError(f"store has no {tier.value} tier")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, f"_{name}", getattr(self, f"_{name}") + delta)

    def read(self, key: ChunkKey, layered: bool = False) -> Hit | None:
        """Look `key` up top-down on this thread (`prefetch` does it on the store's); promote a
        hit into the tiers above; None if every tier misses.

        layered: a durable tier's hit comes back before its data is all read; its `layers`
        gate says how far k and v are filled, the read goes on in the background and the
        entry is promoted once every block has passed. A memory tier's hit is whole.
        """
        if not isinstance(key, ChunkKey):
            raise TypeError(f"key must be a ChunkKey, got {type(key).__name__}")
        started = time.perf_counter()
        self._count(lookups=1)
        for depth, tier in enumerate(self._tiers):
            upper = self._tiers[:depth] if tier.hits_kept_above else ()
            hit = tier.read(key, layered, self._stream_pool.submit, functools.partial(self._promote, upper=upper))
            if hit is None:
                continue
            if hit.layers is not None:  # promoted once whole (on_done)
                header_s = time.perf_counter() - started
                self._time_layered(tier.tier, hit, hit.layers, header_s)
                return Hit(hit.entry, tier.tier, header_s, hit.layers, stored_bytes=hit.stored_bytes,
                           dequant=hit.dequant)
            read_s = time.perf_counter() - started  # a whole read: all of it counts as transfer
            self._timing[tier.tier].observe(0.0, hit.stored_bytes or hit.entry.nbytes, hit.entry.k.shape[2], read_s,
                                            hit.dequant.seconds if hit.dequant is not None else 0.0)
            top = self._promote(hit, upper)
            return Hit(top, tier.tier, time.perf_counter() - started, stored_bytes=hit.stored_bytes,
                       dequant=hit.dequant)
        self._count(misses=1)
        return None

    def _time_layered(self, tier: Tier, hit: Hit, layers: LayerGate, header_s: float) -> None:
        """Measure a layer-wise read: its latency now, its transfer once the last layer is
        verified, in the file's bytes as stored, and its dequantization once the last layer is
        dequantized (by the prompt pass that waits on them: `LayerGate.when_filled`)."""
        t0 = time.perf_counter()
        clock = hit.dequant
        timing, tokens, nbytes = self._timing[tier], hit.entry.k.shape[2], hit.stored_bytes or hit.entry.nbytes
        done = layers.when_ready(layers.num_layers - 1)
        transfer_s = [1e-6 if done is None else 0.0]  # already whole: no transfer to time

        def filled(f: Future[None]) -> None:  # holds no gate: its future is the gate's own
            if f.exception() is None:  # the pass dequantized after the bytes were in: the read took both
                dequant_s = clock.seconds if clock is not None else 0.0
                timing.observe(header_s, nbytes, tokens, transfer_s[0] + dequant_s, dequant_s)

        def verified(_f: object) -> None:
            transfer_s[0] = time.perf_counter() - t0
            layers.when_filled().add_done_callback(filled)

        if done is None:
            layers.when_filled().add_done_callback(filled)
        else:
            done.add_done_callback(verified)

    def read_estimate(self, tier: Tier) -> ReadEstimate | None:
        """`tier`'s measured read speed (None before its first read or when it is not configured)."""
        timing = self._timing.get(tier)
        return None if timing is None else timing.estimate()

    def where(self, key: ChunkKey) -> Tier | None:
        """`where_many` of one key."""
        return self.where_many([key])[0]

    def where_many(self, keys: Sequence[ChunkKey]) -> list[Tier | None]:
        """The tier a read of each key would likely come from: the first tier that says it holds
        it (S3 is not asked: its objects are not listed, so a key no tier above holds is S3's when
        configured), else None. Each tier is asked once for the keys no tier above it holds (the
        peer tier's directory answers them in one call, not one per key)."""
        out: list[Tier | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t in self._tiers:
            if not todo:
                break
            if t.tier is Tier.S3:
                for i in todo:
                    out[i] = Tier.S3
                break
            held = t.contains_many([keys[i] for i in todo])
            for i, h in zip(todo, held):
                if h:
                    out[i] = t.tier
            todo = [i for i, h in zip(todo, held) if not h]
        return out

    def _promote(self, hit: Hit, upper: Sequence[StorageTier]) -> KVEntry:
        """Copy a hit into `upper` (top-down); the entry as held by the topmost that took it."""
        top = hit.entry
        above = [t for t in reversed(upper) if not t.takes_every_hit]  # nearest first, so a failure high up still fills the rest
        # then the tiers that take every hit, wherever they sit: they mirror what the tiers above now
        # hold (the peer tier publishes what the host tier took, in its memory: `PeerTier.joined`)
        mirrors = [t for t in self._tiers if t.takes_every_hit and t.tier is not hit.tier]
        for tier in [*above, *mirrors]:
            try:
                placed = tier.take(hit)
                if placed is not None:
                    top = placed
                self._count(promotions=1)
            except (StoreError, OSError, RuntimeError) as e:
                self._count(promotion_failures=1)
                logger.warning("promotion of %s into %s failed: %s", hit.entry.key.hex, tier.tier.value, e)
        return top

    def contains(self, key: ChunkKey) -> bool:
        """Whether any tier holds a copy (unverified; a get may still miss)."""
        return any(t.contains(key) for t in self._tiers)

    def put(self, entry: KVEntry, *, memory: bool = True, durable: bool = True,
            compression: Compression | None = None) -> int:
        """Store `entry` in every memory tier and write it through to the configured durable tiers.

        Every tier is tried; then, if any durable write failed, StoreError names them.

        Args:
            memory, durable: which kinds of tier to write (a caller may write the durable
                ones later, off its hot path).
            compression: how the durable tiers encode this entry; None: the store's own
                (an index keeps its plain copies in another than its chunks' KV).

        Returns:
            The bytes one copy takes as kept: its encoded file in the durable tiers (the largest,
            where they compress differently), else its tensors' bytes (memory tiers only).
        """
        if not isinstance(entry, KVEntry):
            raise TypeError(f"put needs a KVEntry, got {type(entry).__name__}")
        if entry.model_fp != self.model_fp or entry.tokenizer_fp != self.tokenizer_fp:
            raise ValueError(
                f"entry {entry.key.hex} is for model {entry.model_fp!r} / tokenizer {entry.tokenizer_fp!r}; "
                f"this store serves {self.model_fp!r} / {self.tokenizer_fp!r}"
            )
        encoded: dict[object, bytes] = {}  # by compression, shared by the durable tiers
        failures: list[str] = []
        for tier in self._tiers:
            if _durable(tier):
                if not durable or tier.tier not in self.write_through:
                    continue
                try:
                    tier.write(entry, encoded, compression)
                except StoreError as e:
                    failures.append(f"{tier.tier.value}: {e}")
            elif memory:
                tier.write(entry, encoded)
        if failures:
            raise StoreError(f"put of key {entry.key.hex} failed in {len(failures)} tier(s): {'; '.join(failures)}")
        return max(map(len, encoded.values())) if encoded else entry.nbytes

    def put_many(self, entries: Iterable[KVEntry]) -> None:
        """`put` for each entry."""
        for e in entries:
            self.put(e)

    def delete(self, key: ChunkKey) -> bool:
        """Remove `key` from every tier; True if any held it."""
        return any([t.delete(key) for t in self._tiers])

    def prefetch(self, keys: Iterable[ChunkKey], layered: bool = False) -> list[PrefetchHandle]:
        """Start loading `keys` in the background; one handle per key, in order.

        layered: hits come back once their headers are verified, with `Hit.layers` to wait
        on per layer (`read`); otherwise once the whole entry is verified.
        """
        handles = []
        for key in keys:
            if not isinstance(key, ChunkKey):
                raise TypeError(f"prefetch keys must be ChunkKey, got {type(key).__name__}")
            with self._lock:
                self._prefetches += 1
                future = self._inflight.get((key, layered))
                if future is None:
                    future = self._pool.submit(self.read, key, layered)
                    self._inflight[(key, layered)] = future
                    future.add_done_callback(functools.partial(self._landed, (key, layered)))
                else:
                    self._prefetch_joined += 1
            handles.append(PrefetchHandle(key, future))
        return handles

    def _landed(self, key: tuple[ChunkKey, bool], future: Future[Hit | None]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def held_keys(self) -> dict[Tier, list[ChunkKey]]:
        """The keys each tier of this host holds (GPU, CPU, disk), for a cluster's router; a
        tier shared by every host (S3) is left out."""
        held = {t.tier: t.held_keys() for t in self._tiers}
        return {tier: keys for tier, keys in held.items() if keys is not None}

    def stats(self) -> StoreStats:
        """A snapshot of the store's and every tier's counters."""
        tier_stats = tuple(t.stats() for t in self._tiers)
        with self._lock:
            return StoreStats(
                tiers=tier_stats, lookups=self._lookups, misses=self._misses,
                promotions=self._promotions, promotion_failures=self._promotion_failures,
                prefetches=self._prefetches, prefetch_joined=self._prefetch_joined,
            )

    def close(self) -> None:
        """Wait for prefetches in flight, then release every tier."""
        self._pool.shutdown(wait=True)
        self._stream_pool.shutdown(wait=True)
        for t in self._tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
