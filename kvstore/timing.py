"""How long each tier takes to hand back a chunk's KV, as measured on the reads it served.

A read costs a latency (request to the first verified byte: the file's header checked),
a transfer (the file's bytes as stored after it, at the tier's throughput) and, for a
compressed file, its dequantization (measured apart, per token: the rate of the machine
and device that dequantizes, not of the tier). All are kept per tier as moving averages,
updated as reads complete, so an estimate follows the tier as it is now (a cold S3
prefix, a busy disk) and the files it holds (int4 moves a quarter of bf16's bytes, then
pays its dequantization). The server's loading controller compares the estimate with the
time to recompute the chunk (server/loading_controller.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

_ALPHA = 0.3  # weight of the newest read in the moving averages


@dataclass(frozen=True, slots=True)
class ReadEstimate:
    """A tier's measured read speed."""

    latency_s: float  # seconds to the first verified byte
    bytes_per_s: float  # throughput after it, in stored (file) bytes, dequantization left out
    bytes_per_token: float  # file bytes per token, as stored (dtype and compression)
    reads: int  # reads measured
    dequant_s_per_token: float = 0.0  # dequantization seconds per token (0: uncompressed files)

    def seconds(self, tokens: int) -> float:
        """Estimated seconds to read a chunk of `tokens` tokens whole and dequantize it."""
        return self.latency_s + tokens * (self.bytes_per_token / self.bytes_per_s + self.dequant_s_per_token)


class ReadTiming:
    """Moving averages of one tier's read latency, throughput and dequantization (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latency: float | None = None
        self._rate: float | None = None
        self._per_token: float | None = None
        self._dequant: float = 0.0
        self._reads = 0

    def observe(self, latency_s: float, nbytes: int, tokens: int, transfer_s: float, dequant_s: float = 0.0) -> None:
        """One read of a `tokens`-token chunk: `latency_s` to its first verified byte, then
        `nbytes` (as stored) in `transfer_s`, of which `dequant_s` went to dequantizing."""
        rate, per_token = nbytes / max(transfer_s - dequant_s, 1e-6), nbytes / max(tokens, 1)
        with self._lock:
            self._latency = _avg(self._latency, latency_s)
            self._rate = _avg(self._rate, rate)
            self._per_token = _avg(self._per_token, per_token)
            self._dequant = _avg(self._dequant if self._reads else None, dequant_s / max(tokens, 1))
            self._reads += 1

    def estimate(self) -> ReadEstimate | None:
        """The tier's read speed so far; None before its first measured read."""
        with self._lock:
            if self._latency is None or self._rate is None or self._per_token is None:
                return None
            return ReadEstimate(self._latency, self._rate, self._per_token, self._reads, self._dequant)


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
