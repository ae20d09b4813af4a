"""How fast this engine computes a chunk: learned once, read by whoever plans around it.

The engine measures every chunk it computes (`engine.answer`, and the server's warm-up at
start); the loading controller (`server/loading.py`) reads the rate to decide whether a
chunk's KV is read or computed.
"""

from __future__ import annotations

import threading

_ALPHA = 0.3  # weight of the newest measurement in the moving average


class PrefillSpeed:
    """Tokens per second of chunk prefill, a moving average over the chunks computed.

    Written on the engine's thread, read from any (the loading controller runs on the
    retrieval pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` tokens took `seconds` of engine time."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self._tokens_per_s
            self._tokens_per_s = rate if old is None else (1 - _ALPHA) * old + _ALPHA * rate

    @property
    def tokens_per_s(self) -> float | None:
        """The rate; None until a chunk was measured."""
        with self._lock:
            return self._tokens_per_s
