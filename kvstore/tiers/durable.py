"""DurableTier: the common half of the disk and S3 tiers, which hold chunk files as bytes.

Entries are encoded once (with the store's compression) and written as bytes;
reads are verified by `fileformat.decode` before an entry leaves the tier. A copy
that fails verification is a counted, logged miss and is handed to `_discard`
(quarantine on disk, delete on S3). Verified bytes can move between durable tiers
unchanged (`read` then `take`: `put_file`), so promotion never re-quantizes.
A tier that can read byte ranges (`_source`) also serves layer-ordered reads
(`read(layered=True)`, kvstore.layered): the entry is handed out once its header is checked,
and its layers fill behind compute.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable

import torch

from ragkv.errors import KVFormatError, StoreError
from ragkv.kvstore.compression import Compression, DequantClock, check_supported
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.fileformat import BlockCrcs, decode, encode
from ragkv.kvstore.keys import ChunkKey
from ragkv.kvstore.layered import ByteSource, LayerGate, read_layered
from ragkv.kvstore.tiers.base import Hit, Spawn, StorageTier

logger = logging.getLogger(__name__)


class DurableTier(StorageTier):
    """A tier that stores each chunk as one verified file."""

    streams_layers = False  # True where `_source` gives byte-range reads
    # where a layered read dequantizes a compressed file's layers (the store sets the engine's device)
    dequant_device: torch.device = torch.device("cpu")

    def __init__(
        self,
        model_fp: str,
        tokenizer_fp: str,
        budget_bytes: int | None,
        compression: Compression = Compression.NONE,
    ) -> None:
        super().__init__(model_fp, tokenizer_fp, budget_bytes)
        self.compression = check_supported(compression)

    @abc.abstractmethod
    def _read(self, key: ChunkKey) -> memoryview | bytearray | tuple[memoryview, BlockCrcs | None] | None:
        """The raw bytes under `key` (writable, so tensors can view them), or None if absent.

        A tier that checksums blocks while reading returns (bytes, block CRCs) instead.

        I/O failures are counted as errors and read as None.
        """

    @abc.abstractmethod
    def _write(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        """Store `data` under `key` atomically; False if refused by the budget."""

    @abc.abstractmethod
    def _discard(self, key: ChunkKey, reason: str, source: ByteSource | None = None) -> None:
        """Take a copy that failed verification out of service.

        source: the open file the bad bytes came from, when known: a tier that can tell
            leaves alone a newer file written under the key since (a recomputed copy).
        """

    def _source(self, key: ChunkKey) -> ByteSource | None:
        """Byte-range access to `key`'s file, or None if absent (tiers with `streams_layers`).

        Raises:
            OSError, StoreError: the file is there but cannot be opened.
        """
        raise NotImplementedError(f"{type(self).__name__} does not read byte ranges")

    def _rejected(self, key: ChunkKey, error: Exception, source: ByteSource | None = None) -> None:
        self._counters.add(rejected=1)
        logger.warning("%s tier rejected key %s: %s", self.tier.value, key.hex, error)
        self._discard(key, str(error), source)

    def _read_failed(self, key: ChunkKey, error: BaseException, source: ByteSource | None = None) -> None:
        """A layered read failed: damage is rejected (and discarded), I/O is a counted error (file kept)."""
        if isinstance(error, KVFormatError):
            self._rejected(key, error, source)
        else:
            self._counters.add(errors=1)
            logger.warning("%s tier read of key %s failed: %s", self.tier.value, key.hex, error)

    def read(self, key: ChunkKey, layered: bool = False, spawn: Spawn | None = None,
             on_done: Callable[[Hit], object] | None = None) -> Hit | None:
        """Read and verify `key`'s file (the hit carries its bytes, `Hit.data`); with `layered`
        and `spawn`, layer by layer (`_read_layered`). None on a miss or a rejected copy."""
        if layered and spawn is not None:
            return self._read_layered(key, spawn, on_done or (lambda hit: None))
        return self._read_whole(key)

    def _read_whole(self, key: ChunkKey) -> Hit | None:
        """Read and verify `key`'s file; None on a miss or a rejected copy."""
        started = time.perf_counter()
        got = self._read(key)
        if got is None:
            self._counters.got(started, None)
            return None
        data, crcs = got if isinstance(got, tuple) else (got, None)
        clock = DequantClock()
        try:
            entry = decode(
                data, expected_key=key, model_fp=self.model_fp, tokenizer_fp=self.tokenizer_fp, block_crcs=crcs,
                clock=clock,
            )
        except KVFormatError as e:
            self._counters.got(started, None)
            self._rejected(key, e)
            return None
        self._counters.got(started, len(data))
        return Hit(entry, self.tier, data=data, stored_bytes=len(data), dequant=clock if clock.elements else None)

    def _read_layered(self, key: ChunkKey, spawn: Spawn, on_done: Callable[[Hit], object]) -> Hit | None:
        """Start a layer-ordered read of `key`; None on a miss or a rejected header.

        The hit comes back once the header, token ids and positions are verified; `spawn`
        runs the rest of the read, which calls `on_done(whole hit)` when every block has
        passed. A block that fails later fails the gate and discards the file. A tier
        without byte-range reads reads whole (its gate is complete at once).
        """
        if not self.streams_layers:
            hit = self._read_whole(key)
            if hit is None:
                return None
            on_done(hit)
            return Hit(hit.entry, self.tier, layers=LayerGate.complete(hit.entry.k.shape[0]),
                       stored_bytes=hit.stored_bytes, dequant=hit.dequant)
        started = time.perf_counter()
        try:
            source = self._source(key)
        except (OSError, StoreError) as e:
            self._counters.got(started, None)
            self._read_failed(key, e)
            return None
        if source is None:
            self._counters.got(started, None)
            return None
        size = source.size
        clock = DequantClock()
        try:
            entry, gate = read_layered(source, expected_key=key, model_fp=self.model_fp,
                                       tokenizer_fp=self.tokenizer_fp, spawn=spawn,
                                       on_done=lambda data, whole: on_done(Hit(whole, self.tier, data=data,
                                                                               stored_bytes=len(data))),
                                       on_fail=lambda e: self._read_failed(key, e, source),
                                       device=self.dequant_device, clock=clock)
        except (KVFormatError, OSError, StoreError) as e:
            self._counters.got(started, None)
            self._read_failed(key, e, source)
            return None
        self._counters.got(started, size)
        return Hit(entry, self.tier, layers=gate, stored_bytes=size, dequant=clock)

    def get(self, key: ChunkKey) -> KVEntry | None:
        hit = self._read_whole(key)
        return None if hit is None else hit.entry

    def put(self, entry: KVEntry) -> bool:
        self._check_entry(entry)
        return self.put_file(entry.key, encode(entry, self.compression))

    def take(self, hit: Hit) -> KVEntry | None:
        """Hold a hit from below: its verified file bytes as they are, else its entry encoded."""
        if hit.data is not None:
            self.put_file(hit.entry.key, hit.data)
        else:
            self.put(hit.entry)
        return None

    def write(self, entry: KVEntry, encoded: dict[object, bytes], compression: Compression | None = None) -> bool:
        """`put`, encoding once per compression across one store put's durable tiers (with
        `compression` when given, else the tier's own)."""
        self._check_entry(entry)
        c = self.compression if compression is None else check_supported(compression)
        if c not in encoded:
            encoded[c] = encode(entry, c)
        return self.put_file(entry.key, encoded[c])

    def put_file(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        """Store already encoded (or verified) file bytes under `key`."""
        started = time.perf_counter()
        stored = self._write(key, data)
        self._counters.add(put_seconds=time.perf_counter() - started)
        if stored:
            self._counters.add(puts=1, bytes_written=len(data))
        else:
            self._counters.add(refused=1)
        return stored
