"""DiskTier: chunk files in a directory on local SSD, `{root}/{model_fp}/{key[:2]}/{key}.safetensors`.

Reads copy the file into a fresh buffer block by block and hand each block to the
checksum pool as soon as it is in memory, so verification overlaps the read
(decode then only collects the block CRCs). Writes are atomic: a temp file in the same directory (named with a leading dot, so
no scan or reader ever takes it for a chunk), fsync, rename, fsync of the directory.
A reader therefore sees a whole file or none, also when another process (the
indexer) writes while this one (the server) reads.

The in-memory index (sizes and recency) serves the byte budget. It is rebuilt by
scanning at open, oldest modification time first (hits refresh a file's mtime, so
LRU order survives a restart), and the budget is enforced right then. Files other
processes add later are picked up when read. Each process enforces the budget
against what it knows; `rescan()` refreshes that view.

Bad copies go to `{root}/.quarantine/` with the reason in the log, never deleted silently.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from ragkv.errors import StoreError
from ragkv.kvstore.compression import Compression
from ragkv.kvstore.eviction import EvictionTracker, Policy
from ragkv.kvstore.fileformat import CHECKSUM_BLOCK_BYTES, BlockCrcs, _crc_pool, block_crc, data_start
from ragkv.kvstore.keys import ChunkKey
from ragkv.kvstore.tiers.base import Tier
from ragkv.kvstore.tiers.durable import DurableTier

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
QUARANTINE_DIR = ".quarantine"
STALE_TEMP_SECONDS = 3600.0  # a temp file this old belongs to a writer that died


_FIRST_READ = 1 << 16  # enough for the header of any file we write


def _read_checking(f: io.RawIOBase) -> tuple[memoryview, BlockCrcs | None]:
    """Read a whole file into a fresh buffer, checksumming each block while the next is read.

    The data section's blocks (CHECKSUM_BLOCK_BYTES from its start, as the writer
    cut them) go to the checksum pool as soon as they are in memory, so the CRC pass
    overlaps the I/O instead of following it; decode then only collects the CRCs.
    A short read (a file shrinking under us) returns the short buffer and no CRCs.
    """
    fd = f.fileno()
    size = os.fstat(fd).st_size
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buf = torch.empty(size, dtype=torch.uint8)  # [nbytes], uninitialized: no zero-fill pass
    view = buf.numpy().data  # its buffer, as memoryview(array) gives it
    filled = 0

    def fill(upto: int) -> bool:
        nonlocal filled
        while filled < upto:
            got = f.readinto(view[filled:upto])
            if not got:
                return False
            filled += got
        return True

    if not fill(min(size, _FIRST_READ)):
        return view[:filled], None
    base = data_start(view[:filled])
    if not 8 <= base <= size:
        return (view, None) if fill(size) else (view[:filled], None)
    block = CHECKSUM_BLOCK_BYTES
    pool = _crc_pool()
    futures: list[Future[int]] = []
    for lo in range(base, size, block):
        hi = min(size, lo + block)
        if not fill(hi):
            for fut in futures:
                fut.cancel()
            return view[:filled], None
        futures.append(pool.submit(block_crc, view[lo:hi]))
    if not fill(size):
        return view[:filled], None
    return view, (block, lambda: [fut.result() for fut in futures])


class FileSource:
    """A chunk file open for positioned reads (kvstore.layered's ByteSource)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._closed = False
        try:
            st = os.fstat(self._fd)
            self.size = st.st_size
            self.identity = (st.st_dev, st.st_ino)  # which file this is, should the path be replaced
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            self.close()
            raise

    def reader(self, start: int, end: int) -> _RangeReader:
        return _RangeReader(self._fd, start, end)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class _RangeReader:
    """pread through [start, end) of an open file; several may share one descriptor."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self._fd, self._pos, self._end = fd, start, end

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), self._end - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._pos)
        self._pos += got
        return got


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier(DurableTier):
    """Chunk files under one root directory, for one model, under an optional byte budget."""

    tier = Tier.DISK
    streams_layers = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        model_fp: str,
        tokenizer_fp: str,
        budget_bytes: int | None = None,
        policy: Policy = Policy.LRU,
        compression: Compression = Compression.NONE,
    ) -> None:
        super().__init__(model_fp, tokenizer_fp, budget_bytes, compression)
        self.root = Path(root)
        self.dir = self.root / self.model_fp  # model_fp is one checked path segment
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"disk tier cannot create {str(self.dir)!r}: {e}") from e
        self._lock = threading.Lock()
        self._sizes: dict[ChunkKey, int] = {}
        self._bytes = 0
        self._tracker: EvictionTracker[ChunkKey] = EvictionTracker(policy)
        self.rescan()

    def path(self, key: ChunkKey) -> Path:
        """Where `key`'s file lives (the key is validated hex, so this stays under root)."""
        return self.dir / key.shard / f"{key.hex}{SUFFIX}"

    def rescan(self) -> None:
        """Rebuild the index from the files present, drop stale temp files, enforce the budget."""
        found: list[tuple[float, ChunkKey, int]] = []
        now = time.time()
        for shard in self.dir.iterdir():
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for f in shard.iterdir():
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if f.name.startswith("."):
                    if f.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_SECONDS:
                        f.unlink(missing_ok=True)
                    continue
                try:
                    key = ChunkKey.from_str(f.name.removesuffix(SUFFIX))
                except ValueError:
                    logger.warning("disk tier ignores %s: not a chunk file name", f)
                    continue
                if not f.name.endswith(SUFFIX) or key.shard != shard.name:
                    logger.warning("disk tier ignores %s: misplaced chunk file", f)
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda t: (t[0], t[1].hex))
        with self._lock:
            self._sizes.clear()
            self._tracker = EvictionTracker(self._tracker.policy)
            self._bytes = 0
            for _, key, size in found:
                self._sizes[key] = size
                self._bytes += size
                self._tracker.add(key)
            victims = self._victims_to_fit(0)
        self._unlink_evicted(victims)

    def _victims_to_fit(self, incoming: int) -> list[ChunkKey]:
        """Remove keys from the index until `incoming` more bytes fit (lock held); return them."""
        victims: list[ChunkKey] = []
        if self.budget_bytes is None:
            return victims
        while self._bytes + incoming > self.budget_bytes:
            victim = self._tracker.victim()
            if victim is None:
                break
            self._forget(victim)
            victims.append(victim)
        return victims

    def _forget(self, key: ChunkKey) -> None:
        """Drop `key` from the index (lock held)."""
        self._bytes -= self._sizes.pop(key, 0)
        self._tracker.remove(key)

    def _unlink_evicted(self, victims: list[ChunkKey]) -> None:
        for key in victims:
            self.path(key).unlink(missing_ok=True)
        if victims:
            self._counters.add(evictions=len(victims))

    def _read(self, key: ChunkKey) -> tuple[memoryview, BlockCrcs | None] | None:
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data, crcs = _read_checking(f)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        except OSError as e:
            self._counters.add(errors=1)
            logger.warning("disk tier cannot read %s: %s", path, e)
            return None
        self._note_read(key, path, len(data))
        return data, crcs

    def _note_read(self, key: ChunkKey, path: Path, size: int) -> None:
        """A read of `key`'s file: refresh its recency (and index it if another process wrote it)."""
        with self._lock:
            if key in self._sizes:
                self._tracker.touch(key)
                victims = []
            else:  # written by another process since we scanned
                victims = self._victims_to_fit(size)
                self._sizes[key] = size
                self._bytes += size
                self._tracker.add(key)
        self._unlink_evicted(victims)
        try:
            os.utime(path)  # recency for the next rescan
        except OSError:
            pass

    def _source(self, key: ChunkKey) -> FileSource | None:
        path = self.path(key)
        try:
            source = FileSource(path)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        self._note_read(key, path, source.size)
        return source

    def _write(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        size = len(data)
        if self.budget_bytes is not None and size > self.budget_bytes:
            return False
        path = self.path(key)
        with self._lock:
            known = key in self._sizes
        if known and path.exists():
            with self._lock:
                self._tracker.touch(key)
            return True
        tmp = path.parent / f".{key.hex}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._counters.add(errors=1)
            raise StoreError(f"disk tier cannot write key {key.hex} to {str(path)!r}: {e}") from e
        with self._lock:
            self._forget(key)
            victims = self._victims_to_fit(size)  # before adding, so the new file is never the victim
            self._sizes[key] = size
            self._bytes += size
            self._tracker.add(key)
        self._unlink_evicted(victims)
        return True

    def _discard(self, key: ChunkKey, reason: str, source: object | None = None) -> None:
        path = self.path(key)
        identity = getattr(source, "identity", None)
        if identity is not None:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                with self._lock:
                    self._forget(key)
                return
            if (st.st_dev, st.st_ino) != identity:  # rewritten since this read opened it: keep the new file
                logger.warning("disk tier: bad copy of %s already replaced (%s)", path, reason)
                return
        qdir = self.root / QUARANTINE_DIR
        target = qdir / f"{self.model_fp}.{key.hex}.{int(time.time())}.{secrets.token_hex(2)}{SUFFIX}"
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, target)
            logger.warning("disk tier quarantined %s as %s: %s", path, target, reason)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk tier cannot quarantine %s (%s); removing it: %s", path, e, reason)
            path.unlink(missing_ok=True)
        with self._lock:
            self._forget(key)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            if key in self._sizes:
                return True
        return self.path(key).exists()

    def delete(self, key: ChunkKey) -> bool:
        try:
            self.path(key).unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        with self._lock:
            self._forget(key)
        return existed

    def keys_by_eviction_order(self) -> list[ChunkKey]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return self._tracker.keys_oldest_first()

    def held_keys(self) -> list[ChunkKey]:
        return self.keys_by_eviction_order()

    def _usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._sizes), self._bytes

