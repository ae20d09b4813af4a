"""The KV tree's disk tier: spilled conversation KV as chunk-KV files (`engine.kv.node_files.NodeFiles`).

One file per spilled tree node, `<folder>/<model fingerprint>/<name>.kv`, in the chunk-KV
format (`fileformat`: header checksum, CRC-32C per block of the data, K after RoPE with its
positions), its place in the tree in extra header fields. The file's chunk key is made from
the node's name as its prefix hash, so a file renamed, of another model or another node is
refused on read like a damaged one.

Writes run on one writer thread (the tree spills from the scheduler's thread, which does no
I/O), whole or not at all (`ragkv.atomic`). Until its write is done, a read of the name finds the tensors still in
memory. Deletes go through the same thread, in order.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ragkv.atomic import private_dir, write_bytes
from ragkv.errors import KVFormatError
from ragkv.kvstore.entry import KVEntry, RopeMode
from ragkv.kvstore.fileformat import data_start, decode, encode, read_meta
from ragkv.kvstore.keys import ChunkKey, PrefixHash, check_fingerprint, check_prefix_hash
from ragkv.kvstore.layered import LayerGate, read_layered
from ragkv.kvstore.tiers.disk import FileSource

log = logging.getLogger(__name__)

SUFFIX = ".kv"
_HEAD_BYTES = 64 * 1024  # one read that holds most headers whole (a long path's token ids can be more)


class TreeFiles:
    """Spilled KV-tree nodes of one model, on local disk.

    Args:
        folder: the tree's folder (`ragkv serve --kv-tree-dir`); the model's files go in a
            subfolder named by its fingerprint, so models never read each other's.
        model_fp: the serving model's fingerprint.
        tokenizer_fp: its tokenizer's fingerprint.
    """

    def __init__(self, folder: Path, model_fp: str, tokenizer_fp: str) -> None:
        self.model_fp = check_fingerprint(model_fp, "model fingerprint")
        self.tokenizer_fp = check_fingerprint(tokenizer_fp, "tokenizer fingerprint")
        # 0700 folders, 0600 files: a node's header holds its tenant and the conversation's token ids
        self.folder = private_dir(private_dir(folder, "--kv-tree-dir") / model_fp, "--kv-tree-dir")
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragkv-tree-files")
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ragkv-tree-reads")  # layered reads

    def path(self, name: str) -> Path:
        check_prefix_hash(name)  # 64 hex characters: one path segment, never ".." or a separator
        return self.folder / f"{name}{SUFFIX}"

    def write(self, name: str, meta: Mapping[str, str], ids: Sequence[int], start: int,
              k: torch.Tensor, v: torch.Tensor) -> None:
        path = self.path(name)
        with self._lock:
            self._pending[name] = (k, v)
        self._writer.submit(self._write, name, path, dict(meta), [int(i) for i in ids], start, k, v)

    def _write(self, name: str, path: Path, meta: dict[str, str], ids: list[int], start: int,
               k: torch.Tensor, v: torch.Tensor) -> None:
        try:
            entry = KVEntry(key=self._key(name, ids), k=k.detach().to("cpu"), v=v.detach().to("cpu"),
                            token_ids=torch.tensor(ids, dtype=torch.int64),
                            positions=torch.arange(start, start + len(ids), dtype=torch.int64),
                            model_fp=self.model_fp, tokenizer_fp=self.tokenizer_fp, prefix_hash=PrefixHash(name),
                            rope_mode=RopeMode.POST_ROPE)
            write_bytes(path, encode(entry, extra=meta), mode=0o600, durable=False)  # checked on every read: torn = a miss
        except Exception:  # a full disk: the node is a miss on its next read, never a failed request
            log.exception("KV tree: could not write spilled node %s", name)
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _key(self, name: str, ids: Sequence[int]) -> ChunkKey:
        return ChunkKey.from_prefix_hash(self.model_fp, self.tokenizer_fp, PrefixHash(name), ids)

    def read(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            return pending
        data = bytearray(self.path(name).read_bytes())
        meta = read_meta(data[:data_start(data)], len(data))
        entry = decode(data, expected_key=self._key(name, _ids(name, meta)), model_fp=self.model_fp,
                       tokenizer_fp=self.tokenizer_fp)
        return entry.k, entry.v  # [L, Hkv, T, D] each, views of `data`

    def open(self, name: str) -> tuple[torch.Tensor, torch.Tensor, LayerGate | None]:
        """Start a layer-ordered read of `name` (kvstore.layered) on the read threads: K and V
        fill in as the gate publishes each verified layer. A block that fails its checksum
        fails the gate, and the file is deleted (it is not read again)."""
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            return (*pending, None)
        path = self.path(name)
        key = self._key(name, _ids(name, _head_meta(path)))
        entry, gate = read_layered(FileSource(path), expected_key=key, model_fp=self.model_fp,
                                   tokenizer_fp=self.tokenizer_fp, spawn=self._readers.submit,
                                   on_done=lambda data, whole: None, on_fail=lambda e: self._failed(name, e))
        return entry.k, entry.v, gate  # [L, Hkv, T, D] each, filling in

    def _failed(self, name: str, error: BaseException) -> None:
        """A layered read failed: a damaged file goes (an I/O error leaves it, as kvstore's tiers do)."""
        log.warning("KV tree: reading spilled node %s failed: %s", name, error)
        if isinstance(error, KVFormatError):
            self.delete(name)

    def delete(self, name: str) -> None:
        path = self.path(name)
        with self._lock:
            self._pending.pop(name, None)
        self._writer.submit(path.unlink, missing_ok=True)

    def listing(self) -> Iterator[tuple[str, Mapping[str, str]]]:
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            name = path.name.removesuffix(SUFFIX)
            try:
                check_prefix_hash(name)
                yield name, _head_meta(path)
            except (OSError, ValueError, KVFormatError) as e:  # KVFormatError is a ValueError too
                log.warning("KV tree: skipping %s: %s", path, e)
        for tmp in self.folder.glob(f".*{SUFFIX}.*.tmp"):  # a crash mid-write left it (ragkv.atomic)
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        done: Future[None] = self._writer.submit(lambda: None)
        done.result()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def _head_meta(path: Path) -> dict[str, str]:
    """The metadata in a chunk-KV file's header (checked; the data is not read)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
        if data_start(head) > len(head):
            head += f.read(data_start(head) - len(head))
        return read_meta(head, os.fstat(f.fileno()).st_size)


def _ids(name: str, meta: Mapping[str, str]) -> list[int]:
    """The token ids a tree node file's header names (its chunk key is made with them)."""
    try:
        return [int(i) for i in json.loads(meta["tree_ids"])]
    except (KeyError, ValueError) as e:
        raise KVFormatError(f"tree node file {name} names no tokens: {e}") from None
