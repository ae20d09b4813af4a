"""KeyFilter: a Bloom filter of chunk keys, the compact form in which a replica tells a cluster's
router what its tiers hold (a few bits per key, never the key lists).

The keys are sha256 digests already, so the k bit positions come from the digest itself
(double hashing over two 64-bit words); other strings (conversation ids) are hashed first.
Knows nothing of tiers or routing (`server/routing.py` reads the filters).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """A Bloom filter of chunk keys (or conversation ids): a few bits per key, no key lists.

    The keys are sha256 digests already, so the k bit positions come from the digest itself
    (double hashing over two 64-bit words); other strings are hashed first.
    """

    bits: bytes  # m bits, little-endian within each byte
    k: int  # bits set per key

    @classmethod
    def of(cls, keys: Iterable[str], fp_rate: float = 0.01, min_bits: int = 64) -> KeyFilter:
        """A filter holding `keys`, sized for a false-positive rate of `fp_rate`.

        Raises:
            ValueError: `fp_rate` is not in (0, 1).
        """
        if not 0.0 < fp_rate < 1.0:
            raise ValueError(f"fp_rate must be in (0, 1), got {fp_rate!r}")
        keys = list(keys)
        n = max(len(keys), 1)
        m = max(min_bits, math.ceil(-n * math.log(fp_rate) / math.log(2) ** 2))
        m = (m + 7) // 8 * 8
        k = max(1, round(m / n * math.log(2)))
        bits = bytearray(m // 8)
        for key in keys:
            for pos in _positions(key, k, m):
                bits[pos >> 3] |= 1 << (pos & 7)
        return cls(bytes(bits), k)

    def __contains__(self, key: str) -> bool:
        m = len(self.bits) * 8
        return m > 0 and all(self.bits[p >> 3] >> (p & 7) & 1 for p in _positions(key, self.k, m))

    @property
    def nbytes(self) -> int:
        return len(self.bits)


EMPTY = KeyFilter(b"", 1)


def _positions(key: str, k: int, m: int) -> Iterable[int]:
    raw = bytes.fromhex(key) if len(key) == 64 and _is_hex(key) else hashlib.sha256(key.encode()).digest()
    h1 = int.from_bytes(raw[:8], "little")
    h2 = int.from_bytes(raw[8:16], "little") | 1
    return ((h1 + i * h2) % m for i in range(k))


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True
