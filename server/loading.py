"""The loading controller: for each chunk, load its KV or recompute it, whichever is cheaper.

CacheBlend's loading controller, in our words: a chunk's KV is worth reading only if the
read takes less time than computing it. The read time comes from the tier the chunk sits
in, as measured on the reads that tier served (kvstore.timing: latency plus size over
throughput); the compute time from the engine's measured prefill rate (tokens per second,
learned from the chunks computed while serving, and seeded at start). The cheaper wins;
a read that is chosen but overruns its estimate (by `overrun_factor`, plus a floor) is
abandoned and the chunk computed, so loading never makes a request much slower than
recomputing would. Before a tier has a measured read, loading is assumed cheaper (the
stored KV is what the index was built for); the first reads measure it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ragkv.types import KVSource, Tier

_ALPHA = 0.3  # weight of the newest measurement in the prefill rate's moving average


@dataclass(frozen=True, slots=True)
class ChunkDecision:
    """What the controller chose for one chunk, with the numbers it chose by."""

    load: bool  # read it (else compute it)
    source: KVSource  # LOADED when read; why it is computed otherwise
    tier: Tier | None  # the tier it would be read from; None = in no tier
    load_s: float | None  # estimated read seconds; None = not measured yet
    compute_s: float | None  # estimated compute seconds; None = not measured yet


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """How the controller weighs a read against a recompute."""

    enabled: bool = True  # off: always read what a tier holds (the behaviour before the controller)
    margin: float = 1.0  # compute when read_s > margin x compute_s
    overrun_factor: float = 2.0  # abandon a read still pending at overrun_factor x its estimate ...
    overrun_floor_s: float = 0.05  # ... plus this


class LoadingController:
    """Decides per chunk, and learns the engine's prefill rate (thread-safe)."""

    def __init__(self, config: ControllerConfig = ControllerConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._tokens_per_s: float | None = None

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` tokens was computed in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self._tokens_per_s
            self._tokens_per_s = rate if old is None else (1 - _ALPHA) * old + _ALPHA * rate

    @property
    def tokens_per_s(self) -> float | None:
        with self._lock:
            return self._tokens_per_s

    def decide(self, store, key, tokens: int) -> ChunkDecision:  # noqa: ANN001 - kvstore.TieredStore, ChunkKey
        """Load or compute the chunk under `key` (of `tokens` tokens)."""
        tier = store.where(key)
        rate = self.tokens_per_s
        compute_s = tokens / rate if rate else None
        if tier is None:
            return ChunkDecision(False, KVSource.COMPUTED_MISSING, None, None, compute_s)
        est = store.read_estimate(tier)
        load_s = est.seconds(tokens) if est is not None else None
        if (self.config.enabled and load_s is not None and compute_s is not None
                and load_s > self.config.margin * compute_s):
            return ChunkDecision(False, KVSource.COMPUTED_CHEAPER, tier, load_s, compute_s)
        return ChunkDecision(True, KVSource.LOADED, tier, load_s, compute_s)

    def wait_limit(self, decisions: list[ChunkDecision], hard_limit_s: float) -> float:
        """Seconds to wait for the chosen reads before abandoning the pending ones: the slowest
        estimate times `overrun_factor`, plus the floor; `hard_limit_s` while any is unmeasured."""
        loads = [d.load_s for d in decisions if d.load]
        if not self.config.enabled or not loads or any(s is None for s in loads):
            return hard_limit_s
        return min(hard_limit_s, max(loads) * self.config.overrun_factor + self.config.overrun_floor_s)
