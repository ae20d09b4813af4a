"""Retention that knows agents: the tool latencies a KV tree sees, and how long it pins an
answer's path ahead of LRU eviction until the agent's next call (Continuum's time-to-live)."""

from __future__ import annotations

import threading
from collections import deque


class ToolLatency:
    """The tool latencies a tree sees, and the time-to-live of its pins learned from them.

    A gap is the time from an answer that may end in tool calls to the next call that leases
    its path: the tool's run, the client's turn and the next call's retrieval. The learned
    time-to-live is the `quantile` of the last `window` gaps, within [1 s, `max_s`];
    `default_s` (within the same bounds) before any gap is seen. `max_s` 0 turns pins off.
    """

    def __init__(self, max_s: float = 60.0, default_s: float = 10.0, window: int = 256,
                 quantile: float = 0.9) -> None:
        if max_s < 0 or default_s < 0 or window < 1 or not 0.0 < quantile <= 1.0:
            raise ValueError(f"ToolLatency needs max_s and default_s >= 0, window >= 1 and quantile in (0, 1], "
                             f"got {max_s}, {default_s}, {window}, {quantile}")
        self.max_s, self.default_s, self.quantile = float(max_s), float(default_s), quantile
        self._gaps: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._gaps.append(max(0.0, float(seconds)))

    @property
    def observed(self) -> int:
        return len(self._gaps)

    def ttl(self) -> float:
        """Seconds a pin lasts when the client names none (0 = pins are off)."""
        if self.max_s <= 0:
            return 0.0
        with self._lock:
            gaps = sorted(self._gaps)
        guess = gaps[min(len(gaps) - 1, int(self.quantile * len(gaps)))] if gaps else self.default_s
        return min(max(guess, 1.0), self.max_s)
