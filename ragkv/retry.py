"""Retry with exponential backoff for calls the server answered UNAVAILABLE.

Only UNAVAILABLE is retried (the server is starting, draining, or unreachable), and a
streaming call only before its first message arrived: a retry never repeats tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a client retries UNAVAILABLE."""

    max_attempts: int = 4  # attempts in all, the first included; 1 = never retry
    initial_backoff: float = 0.1  # seconds before the first retry
    max_backoff: float = 2.0  # seconds, cap of one wait
    multiplier: float = 2.0  # growth of the wait per retry
    jitter: float = 0.2  # +- fraction of random spread on each wait

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError(
                f"backoffs must be >= 0, got initial={self.initial_backoff} max={self.max_backoff}"
            )
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def delays(self) -> Iterator[float]:
        """Seconds to wait before each retry (max_attempts - 1 values)."""
        delay = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield min(delay, self.max_backoff) * (1.0 + random.uniform(-self.jitter, self.jitter))
            delay *= self.multiplier


NO_RETRY = RetryPolicy(max_attempts=1)


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed call may be retried: an RpcError with status UNAVAILABLE."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
