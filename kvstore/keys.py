"""ChunkKey: the one name of a chunk's KV, for file names, S3 objects and index entries.

A key is sha256 over (format version, model fingerprint, tokenizer fingerprint,
prefix hash, chunk token ids), each field length-prefixed so no two inputs can
encode alike. A chunk prefilled after context tokens between the prefix and itself
(neighbour-conditioned KV: its most similar chunks) is another KV: its key adds one
more field, the context's own sha256 (`ContextHash`, over the options' tag and the
context's token ids), which a stored file carries beside its prefix hash. Keys without
context hash exactly as before, and no context-free encoding can equal one with
context (the fields are length-prefixed, so the extra one cannot be read as part of
an old one): FORMAT_VERSION stays. The prefix enters through its own sha256 (`PrefixHash`), so a
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
# sha256 of a chunk's context (tag and token ids), as 64 lowercase hex characters.
ContextHash = NewType("ContextHash", str)

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
class ChunkContext:
    """What a chunk was prefilled after, between the shared prefix and its own tokens."""

    tag: str  # the options that chose the context, e.g. "neighbours:m=2,budget=1024,choice=nearest"
    token_ids: tuple[int, ...]  # the context's token ids, in prompt order (may be empty)

    def __post_init__(self) -> None:
        if not isinstance(self.tag, str) or not self.tag:
            raise ValueError(f"context tag must be a non-empty string, got {self.tag!r}")
        object.__setattr__(self, "token_ids", tuple(int(i) for i in self.token_ids))

    def hash(self) -> ContextHash:
        """sha256 of the tag and the token ids: what the key and a stored file carry."""
        return ContextHash(hashlib.sha256(b"ragkv-context\0" + _str_bytes(self.tag)
                                          + _ids_bytes(self.token_ids)).hexdigest())


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
        context: ChunkContext | None = None,
    ) -> ChunkKey:
        """Key of `chunk_ids` prefilled after `prefix_ids` (and `context`) by one model and tokenizer."""
        return cls.from_prefix_hash(model_fp, tokenizer_fp, hash_prefix(prefix_ids), chunk_ids,
                                    context.hash() if context is not None else None)

    @classmethod
    def from_prefix_hash(
        cls,
        model_fp: str,
        tokenizer_fp: str,
        prefix_hash: PrefixHash,
        chunk_ids: Sequence[int],
        context_hash: ContextHash | None = None,
    ) -> ChunkKey:
        """Same as `build`, for a caller that holds the prefix's (and context's) hash, not its ids."""
        check_fingerprint(model_fp, "model fingerprint")
        check_fingerprint(tokenizer_fp, "tokenizer fingerprint")
        check_prefix_hash(prefix_hash)
        h = hashlib.sha256(b"ragkv-chunk\0")
        h.update(struct.pack("<I", FORMAT_VERSION))
        h.update(_str_bytes(model_fp))
        h.update(_str_bytes(tokenizer_fp))
        h.update(_str_bytes(prefix_hash))
        h.update(_ids_bytes(chunk_ids))
        if context_hash is not None:  # absent for plain KV: old keys keep their meaning
            h.update(b"ctx\0")
            h.update(_str_bytes(check_prefix_hash(context_hash)))
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
