"""PeerTier: the chunk KV other replicas hold, read through a shared object store.

A cluster's replicas (`ragkv serve --replicas`) each keep chunk KV in their own host tier.
Each one publishes what it computes, or reads from disk or S3, to the cluster's object store (Ray's,
`kvstore.peer_ray`) as the KV file's own bytes, checksums and all, and tells one
`PeerDirectory` which object holds which `ChunkKey`. A replica that misses a chunk in its
local tiers asks the directory, reads a peer's object, and verifies it like any file
(`fileformat.decode`): damaged bytes are refused and reported, and the chunk is read from the
next tier or computed.

    local tiers (GPU, CPU, disk) ──miss──► PeerTier ──miss──► S3 ──miss──► compute
                                           │ directory.lookup(key)
                                           └ objects.get(handle, timeout)  (verified bytes)

Faults are misses, never hangs: a lookup or read past `read_timeout_s`, an object lost with
its replica, or bytes that fail their checksums each fall through to the next tier, and the
copy is reported lost so the directory stops naming it. What a replica publishes is bounded
(`budget_bytes`): the entries it used least recently are withdrawn first.

Chunk KV is the index's, shared by every tenant of a collection as the local tiers are. The KV
tree (conversations) is never published. This module knows no Ray: the cluster hands it a
directory and an object store (`kvstore.peer_ray`); tests hand it in-process ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ragkv.errors import KVFormatError
from ragkv.kvstore import fileformat
from ragkv.kvstore.compression import Compression
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.keys import ChunkKey
from ragkv.kvstore.layered import ByteSource
from ragkv.kvstore.tiers.base import Hit, StorageTier, Tier
from ragkv.kvstore.tiers.durable import DurableTier
from ragkv.kvstore.tiers.memory import MemoryTier

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0  # a directory entry not published again within this is dropped
REANNOUNCE_S = DEFAULT_TTL_S / 2  # a replica names what it still holds to the directory again this often
DEFAULT_MAX_ENTRIES = 100_000  # copies a directory names at most (the oldest go first)
LOOKUP_MEMO_S = 1.0  # a replica reuses a directory answer this long (a request asks per chunk twice)
_MEMO_MAX = 4096  # directory answers a replica remembers


class PeerReadError(Exception):
    """A peer's object could not be read: lost with its replica, evicted, or past the deadline."""


@dataclass(frozen=True, slots=True)
class PeerCopy:
    """One replica's published copy of a chunk's KV file."""

    replica: str  # the replica that published it
    handle: object  # the object store's handle to its bytes (a Ray ObjectRef, boxed in a list)
    nbytes: int  # the file's size
    published_at: float  # the directory's clock when it was published


class _Published(NamedTuple):
    """One copy this replica published."""

    handle: object  # the object store's handle
    nbytes: int  # the file's size
    plain: bool  # uncompressed: the host tier can hold the chunk in the object's memory (`PeerTier._share`)


class Directory(Protocol):
    """What a PeerTier asks of the cluster's directory: `PeerDirectory` in one process, its
    Ray actor behind `kvstore.peer_ray.RayDirectory` in a cluster."""

    def publish(self, key: str, replica: str, handle: object, nbytes: int) -> None: ...
    def publish_many(self, replica: str, copies: list[tuple[str, object, int]]) -> None: ...  # (key, handle, nbytes)
    def withdraw(self, replica: str, keys: list[str]) -> None: ...
    def lookup_many(self, keys: list[str]) -> list[list[PeerCopy]]: ...
    def lost(self, key: str, replica: str) -> None: ...
    def settled(self, timeout_s: float) -> bool: ...  # the events sent so far have reached the directory


class ObjectStore(Protocol):
    """Where published bytes live: Ray's object store in a cluster (`kvstore.peer_ray.RayObjects`)."""

    def put(self, data: bytes) -> object:
        """Store `data`; a handle any replica can read it by (kept alive while referenced)."""

    def get(self, handle: object, timeout_s: float) -> bytes | memoryview:
        """The bytes under `handle`. Raises PeerReadError: lost, evicted, or not within `timeout_s`."""

    def view(self, handle: object) -> memoryview | None:
        """The bytes of an object this process put, read-only, in the store's own memory with no
        copy (the host tier then holds them: one copy on this host, not two); None where the store
        cannot give such a view."""


class PeerDirectory:
    """Which replicas hold which chunk's KV: chunk key (hex) -> replica -> `PeerCopy`.

    Fed by publish and withdraw events, pruned by time-to-live, by the replicas' own reports
    of copies they could not read (`lost`), and by the cluster when a replica dies (`forget`).
    Bounded: past `max_entries` copies the oldest published go first. Thread-safe; in a
    cluster it is one named Ray actor (`kvstore.peer_ray`).
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"a peer directory needs ttl_s > 0 and max_entries >= 1, got {ttl_s} and {max_entries}")
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._lock = threading.Lock()
        # (key, replica) -> copy, in publish order: the front is the oldest (the bound and the TTL cut there)
        self._copies: OrderedDict[tuple[str, str], PeerCopy] = OrderedDict()
        self._by_key: dict[str, set[str]] = {}  # key -> replicas holding it
        self.dropped = 0  # copies dropped by the bound, the TTL, `lost` and `forget`

    def publish(self, key: str, replica: str, handle: object, nbytes: int) -> None:
        """`replica` holds `key`'s file in the object under `handle` (newer than any it held before)."""
        with self._lock:
            self._drop((key, replica))
            self._copies[(key, replica)] = PeerCopy(replica, handle, nbytes, self._clock())
            self._by_key.setdefault(key, set()).add(replica)
            self._expire()
            while len(self._copies) > self.max_entries:
                self._drop(next(iter(self._copies)))
                self.dropped += 1

    def publish_many(self, replica: str, copies: list[tuple[str, object, int]]) -> None:
        """`publish` of each (key, handle, nbytes), in one call (a replica naming what it still holds)."""
        for key, handle, nbytes in copies:
            self.publish(key, replica, handle, nbytes)

    def withdraw(self, replica: str, keys: list[str]) -> None:
        """`replica` no longer publishes `keys` (it evicted them)."""
        with self._lock:
            for key in keys:
                self._drop((key, replica))

    def lookup(self, key: str) -> list[PeerCopy]:
        """The live copies of `key`, newest first."""
        with self._lock:
            self._expire()
            copies = [self._copies[(key, r)] for r in self._by_key.get(key, ())]
        return sorted(copies, key=lambda c: c.published_at, reverse=True)

    def lookup_many(self, keys: list[str]) -> list[list[PeerCopy]]:
        """`lookup` of each key, in one call (a request's chunks)."""
        return [self.lookup(k) for k in keys]

    def lost(self, key: str, replica: str) -> None:
        """A reader could not read `replica`'s copy of `key` (gone, or damaged): stop naming it."""
        with self._lock:
            if self._drop((key, replica)):
                self.dropped += 1

    def settled(self, timeout_s: float) -> bool:
        """Events reach this directory as they are sent (it is in this process)."""
        return True

    def forget(self, replica: str) -> int:
        """Drop every copy `replica` published (it died, or stopped); returns how many."""
        with self._lock:
            gone = [k for k in self._copies if k[1] == replica]
            for k in gone:
                self._drop(k)
            self.dropped += len(gone)
            return len(gone)

    def stats(self) -> dict[str, int]:
        """Copies named now, their bytes, the replicas publishing, and copies dropped so far."""
        with self._lock:
            self._expire()
            return {"copies": len(self._copies), "bytes": sum(c.nbytes for c in self._copies.values()),
                    "replicas": len({r for _, r in self._copies}), "dropped": self.dropped}

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._copies:
            first = next(iter(self._copies))
            if self._copies[first].published_at > cutoff:
                break
            self._drop(first)
            self.dropped += 1

    def _drop(self, k: tuple[str, str]) -> bool:
        if self._copies.pop(k, None) is None:
            return False
        held = self._by_key.get(k[0])
        if held is not None:
            held.discard(k[1])
            if not held:
                del self._by_key[k[0]]
        return True


class PeerTier(DurableTier):
    """The chunk KV of the cluster's other replicas, and this replica's share of it.

    Reads ask the directory and fetch a peer's verified bytes (`DurableTier` decodes and checks
    them); they are read through, not copied into this replica's own tiers (`keep_reads`).
    Writes (the store's puts of computed KV, and every hit another tier gave: disk, S3) publish,
    off the caller's thread, within `budget_bytes` of this replica's own objects.
    """

    tier = Tier.PEER
    takes_every_hit = True  # what a local disk gives the host tier is published too

    def __init__(self, replica: str, directory: Directory, objects: ObjectStore, model_fp: str, tokenizer_fp: str,
                 budget_bytes: int, compression: Compression = Compression.NONE, read_timeout_s: float = 2.0,
                 keep_reads: bool = False, clock: Callable[[], float] = time.monotonic,
                 reannounce_s: float = REANNOUNCE_S) -> None:
        """
        Args:
            replica: this replica's name in the directory.
            budget_bytes: this replica's published bytes at most (`--peer-tier-bytes`).
            read_timeout_s: a lookup and a read each give up after this.
            keep_reads: copy what is read from a peer into this replica's own tiers too. Off by
                default: the pool then holds each chunk about once, not once per replica that
                read it (replayed on 20 held-out seeds of the cluster bench's workload, chunk
                routing's local-plus-peer hits go from 0.84 to 0.89 of one pooled tier's, pow2's
                from 0.80 to 0.96: docs/quality.md), at the price of a peer read each time.
            reannounce_s: what this replica still publishes is named to the directory again once
                its last announcement is this old (under the directory's time-to-live, which
                drops a copy nobody names again: one the replica keeps using stays found).
        """
        if budget_bytes is None or budget_bytes <= 0:
            raise ValueError(f"a peer tier needs a byte budget > 0, got {budget_bytes!r}")
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        super().__init__(model_fp, tokenizer_fp, budget_bytes, compression)
        self.replica, self.directory, self.objects = replica, directory, objects
        self.read_timeout_s = read_timeout_s
        self.hits_kept_above = keep_reads
        self._clock = clock
        self._lock = threading.Lock()
        self._published: OrderedDict[ChunkKey, _Published] = OrderedDict()  # least recently used first
        self._host: MemoryTier | None = None  # the store's host tier, which holds what is published in its memory
        self._announced: OrderedDict[ChunkKey, float] = OrderedDict()  # when the directory was last told, oldest first
        self.reannounce_s = reannounce_s
        self._reannouncing = False  # a pass over the oldest announcements is queued
        self._bytes = 0
        self._memo: OrderedDict[ChunkKey, tuple[float, list[PeerCopy]]] = OrderedDict()
        self._reading: dict[ChunkKey, str] = {}  # the replica whose copy a read of the key took
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-peer-publish")
        self.pending_publishes = 0  # publishes queued, not yet in the object store

    # -- reads ----------------------------------------------------------------------------

    def copies(self, key: ChunkKey) -> list[PeerCopy]:
        """The directory's live copies of `key`; [] when the directory cannot answer in time."""
        return self._lookup([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether the directory names a copy of each key, in one lookup (a request's chunks,
        priced by the loading controller; its reads then reuse the answer)."""
        return [bool(c) for c in self._lookup(keys)]

    def _lookup(self, keys: Sequence[ChunkKey]) -> list[list[PeerCopy]]:
        """Each key's live copies: the directory is asked once for the keys it has not answered
        for within `LOOKUP_MEMO_S`; a directory that cannot answer in time names none."""
        now = self._clock()
        with self._lock:
            known = {k: m[1] for k in keys if (m := self._memo.get(k)) is not None and now - m[0] < LOOKUP_MEMO_S}
        ask = [k for k in dict.fromkeys(keys) if k not in known]
        if ask:
            try:
                found = self.directory.lookup_many([k.hex for k in ask])
            except PeerReadError as e:
                self._counters.add(errors=1)
                logger.warning("peer directory lookup of %d keys failed: %s", len(ask), e)
                found = [[] for _ in ask]
            known.update(zip(ask, found))
            with self._lock:
                for k, copies in zip(ask, found):
                    self._memo[k] = (now, copies)
                    self._memo.move_to_end(k)
                while len(self._memo) > _MEMO_MAX:
                    self._memo.popitem(last=False)
        return [known[k] for k in keys]

    def _read(self, key: ChunkKey) -> memoryview | None:
        for copy in self.copies(key):
            try:
                data = self.objects.get(copy.handle, self.read_timeout_s)
            except PeerReadError as e:
                self._counters.add(errors=1)
                logger.warning("peer read of %s from replica %s failed: %s", key.hex, copy.replica, e)
                self._lost(key, copy.replica)
                continue
            with self._lock:
                self._reading[key] = copy.replica
            return memoryview(bytearray(data))  # writable: the entry's tensors view it
        return None

    def _discard(self, key: ChunkKey, reason: str, source: ByteSource | None = None) -> None:
        """A peer's copy failed verification: the directory stops naming it."""
        with self._lock:
            replica = self._reading.pop(key, None)
        if replica is not None:
            self._lost(key, replica)

    def _lost(self, key: ChunkKey, replica: str) -> None:
        with self._lock:
            self._memo.pop(key, None)
        try:
            self.directory.lost(key.hex, replica)
        except PeerReadError as e:
            logger.warning("telling the peer directory %s's copy of %s is lost failed: %s", replica, key.hex, e)

    def read(self, key: ChunkKey, layered: bool = False, spawn: object = None,
             on_done: Callable[[Hit], object] | None = None) -> Hit | None:
        hit = super().read(key, layered, spawn, on_done)  # type: ignore[arg-type]
        with self._lock:
            self._reading.pop(key, None)
        return hit

    def contains(self, key: ChunkKey) -> bool:
        """Whether the directory names a copy (the loading controller prices the read then)."""
        return bool(self.copies(key))

    def held_keys(self) -> list[ChunkKey] | None:
        return None  # the cluster's, not this host's: routing summaries leave it out

    # -- one copy on the host ---------------------------------------------------------------

    def joined(self, tiers: Sequence[StorageTier]) -> None:
        """Publish what the store's host tier holds, in the host tier's memory:
        - a chunk this replica publishes is held by its host tier in the published object's
          memory, not in a second copy of its own (`_share`). Only uncompressed copies can be: a
          compressed one (the tier's compression, or a file published as it was stored, an
          index's int8 plain copy) is not the host tier's KV;
        - what the host tier evicts is withdrawn, and what it no longer holds when its turn to
          be published comes (the publisher runs behind under load) is not published: the objects
          stay within what the host tier holds, not its size again beside it.
        Replayed on 20 held-out seeds, two copies in the same memory made the peer tier a loss
        (docs/quality.md)."""
        host = [t for t in tiers if isinstance(t, MemoryTier) and t.tier is Tier.CPU]
        self._host = host[0] if host else None
        if self._host is not None:
            self._host.on_leaving(self._host_left)

    def _host_left(self, keys: list[ChunkKey]) -> None:
        """(On the thread the host tier evicted on.) Withdraw those keys, after any publish queued."""
        with self._lock:
            if not any(k in self._published for k in keys) and not self.pending_publishes:
                return
        self._queue(lambda: self._withdraw(keys))

    def _withdraw(self, keys: list[ChunkKey]) -> None:
        """(On the publisher's thread.) Stop publishing `keys` that the host tier no longer holds."""
        host = self._host
        gone = []
        with self._lock:
            for key in keys:
                if host is not None and host.contains(key):  # back in the host tier since
                    continue
                if self._unpublish(key):
                    gone.append(key.hex)
        if gone:
            self._counters.add(evictions=len(gone))
            self.directory.withdraw(self.replica, gone)

    def _publish_held(self, key: ChunkKey, publish: Callable[[], object]) -> None:
        """(On the publisher's thread.) `publish()`, unless the host tier has let `key` go since it was queued."""
        if self._host is None or self._host.contains(key):
            publish()

    def _share(self, key: ChunkKey, handle: object) -> None:
        """(On the publisher's thread.) Have the host tier hold `key` in its published object's memory
        (an uncompressed copy: `_Published.plain`)."""
        host = self._host
        if host is None or not host.can_share(key):
            return
        view = self.objects.view(handle)
        if view is None:
            return

        def decode() -> KVEntry:
            return fileformat.decode(view, expected_key=key, model_fp=self.model_fp,
                                     tokenizer_fp=self.tokenizer_fp, shared=True)
        try:
            host.share(key, decode)
        except KVFormatError as e:  # the object is what this replica wrote: a bug or damage in memory
            self._counters.add(errors=1)
            logger.warning("sharing the published copy of %s with the host tier failed: %s", key.hex, e)

    # -- writes ---------------------------------------------------------------------------

    def write(self, entry: KVEntry, encoded: dict[object, bytes], compression: Compression | None = None) -> bool:
        """Publish computed KV, encoded on the publisher's thread (the caller's put goes on), in
        the peer tier's own compression."""
        self._check_entry(entry)
        if self._touch(entry.key):
            return True
        data = encoded.get(self.compression)
        self._queue(lambda: self._publish_held(entry.key, lambda: self.put(entry) if data is None
                                               else self.put_file(entry.key, data)))
        return True

    def take(self, hit: Hit) -> KVEntry | None:
        """Publish what another tier gave (disk, S3): its verified bytes as they are. A chunk
        already published is this replica's most recent again: the store hands every hit here
        (`takes_every_hit`), the host tier's too, so what goes first when the budget is full is
        what this replica has used least recently, as its host tier's LRU would (first published,
        first withdrawn kept a hot chunk's copy no longer than a cold one's)."""
        if not self._touch(hit.entry.key):
            self._queue(lambda: self._publish_held(hit.entry.key, lambda: DurableTier.take(self, hit)))
        return None

    def _touch(self, key: ChunkKey) -> bool:
        """Whether `key` is published; if so it becomes the last to be withdrawn (and what this
        replica has not named to the directory for `reannounce_s` is named again, off this thread)."""
        with self._lock:
            if key not in self._published:
                return False
            self._published.move_to_end(key)
            copy = self._published[key]
            due = self._reannounce_due()
        if due:
            self._queue(self._reannounce)
        if copy.plain and self._host is not None and self._host.can_share(key):  # the host tier read it again
            self._queue(lambda: self._share(key, copy.handle))
        return True

    def _reannounce_due(self) -> bool:
        """(Under the lock.) Whether the oldest announcement is due and no pass is queued yet."""
        if self._reannouncing or not self._announced:
            return False
        if self._clock() - next(iter(self._announced.values())) < self.reannounce_s:
            return False
        self._reannouncing = True
        return True

    def _reannounce(self) -> None:
        """Name every copy announced `reannounce_s` ago or more to the directory again (the
        directory drops a copy not named within its time-to-live, held or not)."""
        now = self._clock()
        again = []
        with self._lock:
            self._reannouncing = False
            due = []
            for key, at in self._announced.items():  # oldest first: stop at the first not yet due
                if now - at < self.reannounce_s:
                    break
                due.append(key)
            for key in due:  # (named now: to the back)
                del self._announced[key]
                if key in self._published:
                    self._announced[key] = now
                    copy = self._published[key]
                    again.append((key.hex, copy.handle, copy.nbytes))
        if again:
            self.directory.publish_many(self.replica, again)

    def put_file(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        if key in self._published:  # queued twice (two hits before the first publish): published once
            return True
        return super().put_file(key, data)

    def _queue(self, publish: Callable[[], object]) -> None:
        with self._lock:
            self.pending_publishes += 1

        def run() -> None:
            try:
                publish()
            except Exception as e:  # a publish is an optimisation: the chunk stays where it is
                self._counters.add(errors=1)
                logger.warning("publishing to the peer tier failed: %s", e)
            finally:
                with self._lock:
                    self.pending_publishes -= 1

        self._publisher.submit(run)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the queued publishes are in the object store and the directory names them
        (tests, shutdown); False if some are still pending after `timeout_s`."""
        end = time.monotonic() + timeout_s
        while self.pending_publishes and time.monotonic() < end:
            time.sleep(0.005)
        return not self.pending_publishes and self.directory.settled(max(0.0, end - time.monotonic()))

    def _write(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        n = len(data)
        assert self.budget_bytes is not None
        if n > self.budget_bytes:
            return False
        # a compressed file (this tier's compression, or one published as it was stored: an index's
        # int8 plain copy) is not the KV the host tier holds, which is dequantized
        plain = fileformat.check_head(memoryview(data), expected_key=key, model_fp=self.model_fp,
                                      tokenizer_fp=self.tokenizer_fp).header.compression is Compression.NONE
        handle = self.objects.put(bytes(data))
        gone: list[ChunkKey] = []
        with self._lock:
            while self._published and self._bytes + n > self.budget_bytes:
                old = next(iter(self._published))  # the least recently used goes first
                self._unpublish(old)
                gone.append(old)
            self._published[key] = _Published(handle, n, plain)
            self._announced[key] = self._clock()
            self._bytes += n
            due = self._reannounce_due()
        if due:
            self._reannounce()  # (on the publisher's thread already)
        if gone:
            self._counters.add(evictions=len(gone))
            self.directory.withdraw(self.replica, [k.hex for k in gone])
        self.directory.publish(key.hex, self.replica, handle, n)
        if plain:
            self._share(key, handle)
        return True

    def _unpublish(self, key: ChunkKey) -> bool:
        """(Under the lock.) Forget this replica's copy of `key`; whether there was one (the caller
        withdraws it from the directory)."""
        held = self._published.pop(key, None)
        self._announced.pop(key, None)
        if held is not None:
            self._bytes -= held.nbytes
        return held is not None

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            held = self._unpublish(key)
        if held:
            self.directory.withdraw(self.replica, [key.hex])
        return held

    def _usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._published), self._bytes

    def close(self) -> None:
        """Withdraw everything this replica published (its objects go with it)."""
        self._publisher.shutdown(wait=True)
        with self._lock:
            keys = [k.hex for k in self._published]
            self._published.clear()
            self._announced.clear()
            self._bytes = 0
        if keys:
            try:
                self.directory.withdraw(self.replica, keys)
            except PeerReadError as e:
                logger.warning("withdrawing %d published chunks failed: %s", len(keys), e)
