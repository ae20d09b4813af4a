"""DurableTier: the common half of the disk and S3 tiers, which hold chunk files as bytes.

Entries are encoded once (with the store's compression) and written as bytes;
reads are verified by `fileformat.decode` before an entry leaves the tier. A copy
that fails verification is a counted, logged miss and is handed to `_discard`
(quarantine on disk, delete on S3). Verified bytes can move between durable tiers
unchanged (`fetch` then `put_file`), so promotion never re-quantizes.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass

from kvstore.compression import Compression, check_supported
from kvstore.entry import KVEntry
from kvstore.fileformat import BlockCrcs, decode, encode
from kvstore.keys import ChunkKey
from kvstore.tiers.base import StorageTier
from ragkv.errors import KVFormatError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FileHit:
    """A verified read from a durable tier."""

    entry: KVEntry  # the decoded entry (views of `data` when uncompressed)
    data: memoryview | bytearray  # the file's bytes, verified


class DurableTier(StorageTier):
    """A tier that stores each chunk as one verified file."""

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
    def _discard(self, key: ChunkKey, reason: str) -> None:
        """Take a copy that failed verification out of service."""

    def fetch(self, key: ChunkKey) -> FileHit | None:
        """Read and verify `key`'s file; None on a miss or a rejected copy."""
        started = time.perf_counter()
        got = self._read(key)
        if got is None:
            self._counters.got(started, None)
            return None
        data, crcs = got if isinstance(got, tuple) else (got, None)
        try:
            entry = decode(
                data, expected_key=key, model_fp=self.model_fp, tokenizer_fp=self.tokenizer_fp, block_crcs=crcs
            )
        except KVFormatError as e:
            self._counters.add(rejected=1)
            self._counters.got(started, None)
            logger.warning("%s tier rejected key %s: %s", self.tier.value, key.hex, e)
            self._discard(key, str(e))
            return None
        self._counters.got(started, len(data))
        return FileHit(entry, data)

    def get(self, key: ChunkKey) -> KVEntry | None:
        hit = self.fetch(key)
        return None if hit is None else hit.entry

    def put(self, entry: KVEntry) -> bool:
        self._check_entry(entry)
        return self.put_file(entry.key, encode(entry, self.compression))

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
