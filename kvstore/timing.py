"""How long each tier takes to hand back a chunk's KV, as measured on the reads it served.

A read costs a latency (request to the first verified byte: the file's header checked)
and a transfer (the bytes after it, at the tier's throughput). Both are kept per tier as
moving averages, updated as reads complete, so an estimate follows the tier as it is now
(a cold S3 prefix, a busy disk). The server's loading controller compares the estimate
with the time to recompute the chunk (server/loading.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

_ALPHA = 0.3  # weight of the newest read in the moving averages


@dataclass(frozen=True, slots=True)
class ReadEstimate:
    """A tier's measured read speed."""

    latency_s: float  # seconds to the first verified byte
    bytes_per_s: float  # throughput after it
    bytes_per_token: float  # size of the chunks read, per token (dtype and compression as stored)
    reads: int  # reads measured

    def seconds(self, tokens: int) -> float:
        """Estimated seconds to read a chunk of `tokens` tokens whole."""
        return self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s


class ReadTiming:
    """Moving averages of one tier's read latency and throughput (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latency: float | None = None
        self._rate: float | None = None
        self._per_token: float | None = None
        self._reads = 0

    def observe(self, latency_s: float, nbytes: int, tokens: int, transfer_s: float) -> None:
        """One read of a `tokens`-token chunk: `latency_s` to its first verified byte, then
        `nbytes` in `transfer_s`."""
        rate, per_token = nbytes / max(transfer_s, 1e-6), nbytes / max(tokens, 1)
        with self._lock:
            self._latency = _avg(self._latency, latency_s)
            self._rate = _avg(self._rate, rate)
            self._per_token = _avg(self._per_token, per_token)
            self._reads += 1

    def estimate(self) -> ReadEstimate | None:
        """The tier's read speed so far; None before its first measured read."""
        with self._lock:
            if self._latency is None or self._rate is None or self._per_token is None:
                return None
            return ReadEstimate(self._latency, self._rate, self._per_token, self._reads)


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
