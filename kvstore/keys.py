"""ChunkKey: the one name of a chunk's KV, for file names, S3 objects and index entries.

A key is sha256 over (format version, model fingerprint, tokenizer fingerprint,
prefix hash, chunk token ids), each field length-prefixed so no two inputs can
encode alike. The prefix enters through its own sha256 (`PrefixHash`), so a
stored file, which carries the prefix hash and its token ids, can prove it is
the file its name says. Python's `hash()` is never used: it is salted per process.

This module knows nothing of tensors' values, tiers or files.
"""

from __future__ import annotations

import hashlib
import re
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

# Bump when the key derivation or the file layout changes: old files then stop matching.
# 2: the data checksum is a CRC-32 per fixed block (checksum_block), verified in parallel.
# 3: the checksums are CRC-32C (the CPU's own instruction; 5x zlib's CRC-32 a core).
FORMAT_VERSION = 3

# sha256 of the prefix token ids, as 64 lowercase hex characters.
PrefixHash = NewType("PrefixHash", str)

_HEX64 = re.compile(r"[0-9a-f]{64}")
# Fingerprints name a directory on disk and an S3 path segment: no separators,
# no leading dot (so "." / ".." and our ".quarantine" can never be one).
_FINGERPRINT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_fingerprint(fp: str, what: str = "fingerprint") -> str:
    """Return `fp` if it is safe as one path segment, else raise ValueError.

    Args:
        fp: a model or tokenizer fingerprint.
        what: what `fp` is, for the error message.
    """
    if not isinstance(fp, str) or _FINGERPRINT.fullmatch(fp) is None:
        raise ValueError(
            f"{what} {fp!r} is not allowed: use 1-128 characters of [A-Za-z0-9._-], "
            "not starting with '.', '_' or '-'"
        )
    return fp


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, prefixed by their count."""
    packed = array("q", (int(i) for i in ids))
    if struct.pack("=q", 1) != struct.pack("<q", 1):
        packed.byteswap()
    return struct.pack("<Q", len(packed)) + packed.tobytes()


def _str_bytes(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def hash_prefix(prefix_ids: Sequence[int]) -> PrefixHash:
    """sha256 of the shared prefix's token ids (the system prompt, or BOS)."""
    return PrefixHash(hashlib.sha256(b"ragkv-prefix\0" + _ids_bytes(prefix_ids)).hexdigest())


def check_prefix_hash(value: str) -> PrefixHash:
    """Return `value` as a PrefixHash if it is 64 lowercase hex characters, else raise ValueError."""
    if not isinstance(value, str) or _HEX64.fullmatch(value) is None:
        raise ValueError(f"prefix hash {value!r} is not 64 lowercase hex characters")
    return PrefixHash(value)


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """The name of one chunk's KV under one model, tokenizer and prefix."""

    hex: str  # sha256 digest, 64 lowercase hex characters

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or _HEX64.fullmatch(self.hex) is None:
            raise ValueError(f"chunk key {self.hex!r} is not 64 lowercase hex characters")

    @classmethod
    def build(
        cls,
        model_fp: str,
        tokenizer_fp: str,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[int],
    ) -> ChunkKey:
        """Key of `chunk_ids` prefilled after `prefix_ids` by one model and tokenizer."""
        return cls.from_prefix_hash(model_fp, tokenizer_fp, hash_prefix(prefix_ids), chunk_ids)

    @classmethod
    def from_prefix_hash(
        cls,
        model_fp: str,
        tokenizer_fp: str,
        prefix_hash: PrefixHash,
        chunk_ids: Sequence[int],
    ) -> ChunkKey:
        """Same as `build`, for a caller that holds the prefix's hash, not its ids."""
        check_fingerprint(model_fp, "model fingerprint")
        check_fingerprint(tokenizer_fp, "tokenizer fingerprint")
        check_prefix_hash(prefix_hash)
        h = hashlib.sha256(b"ragkv-chunk\0")
        h.update(struct.pack("<I", FORMAT_VERSION))
        h.update(_str_bytes(model_fp))
        h.update(_str_bytes(tokenizer_fp))
        h.update(_str_bytes(prefix_hash))
        h.update(_ids_bytes(chunk_ids))
        return cls(h.hexdigest())

    def to_str(self) -> str:
        """The key as 64 lowercase hex characters (a file or object name stem)."""
        return self.hex

    @classmethod
    def from_str(cls, s: str) -> ChunkKey:
        """Parse a key string; raise ValueError naming `s` if it is not a key."""
        return cls(s)

    @property
    def shard(self) -> str:
        """The first two hex characters: the directory a key's file lives in."""
        return self.hex[:2]

    def __str__(self) -> str:
        return self.hex
