"""The loading controller: for each chunk, load its KV or recompute it, whichever makes the
request's KV ready sooner.

CacheBlend's loading controller, in our words: a chunk's KV is worth reading only if reading
it does not make the request wait longer than computing it would. The read time comes from
the tier the chunk sits in, as measured on the reads that tier served (kvstore.timing:
latency, plus the file's bytes as stored over the tier's throughput, plus the measured
dequantization time per token of compressed files: an int4 file moves 0.31x of bf16's bytes
and then pays its dequantization, so a slow tier that loses to recompute in bf16 can win in
int4); the compute time from the engine's prefill rate
(`Engine.speed`, `engine/speed.py`: tokens per second, seeded at start and learned from every chunk the
engine computes). Reads run in parallel, `store.prefetch_workers` at a time, off the engine; the
chunks to compute run one after another on the engine (which every other request needs
too, so compute counts `margin` times its time). The request's KV is ready when both are
done, so the controller computes the chunks whose reads are slowest for as long as that
brings the ready time down. A read that is chosen but overruns its estimate (plus a floor)
races its chunk's compute: the compute starts, and stops at the layer where the read lands,
if it lands first (`engine/answer.py`). Before a tier has a measured read, loading is chosen
(the stored KV is what the index was built for), for at most the time computing those
chunks would take; the first reads measure it.

One more way is weighed per request: full prefill of the whole prompt, which reads nothing
(`prefers_full`). Computing chunks one by one and then blending them is slower than one pass
over the prompt on a GPU: an H100 prefilled 512-token chunks of an 8B model at 11.9k tokens/s
and whole 8K-token prompts at 32k, and read KV from local disk at 1.5 GB/s, where the model
makes 128 KiB of it per token. There the best mix of reads and computes, plus blend's own pass,
took 1.8-2.4x full prefill's time. A request whose every chunk sits in some tier is served by
full prefill when that is clearly sooner by the engine's measured pass rates (`EngineSpeed`):
its answer is full prefill's, and its chunks count as computed because cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.engine.speed import EngineSpeed
from ragkv.types import KVSource, Mode, Tier


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
    """How the controller weighs reads against recomputes."""

    enabled: bool = True  # off: always read what a tier holds (the behaviour before the controller)
    margin: float = 1.2  # a second of compute counts this much: the engine is every request's
    # a read still pending at overrun_factor x its estimate, plus the floor, races its chunk's
    # compute (the first to finish serves: engine/answer.py): waiting longer only loses time
    overrun_factor: float = 1.0
    overrun_floor_s: float = 0.05
    # full prefill replaces the chunk plan when it is sooner by this factor and these seconds
    # (a clear win, not timing noise on small prompts)
    full_factor: float = 1.25
    full_floor_s: float = 0.05


class LoadingController:
    """Decides per request which chunks to read and which to compute, by the engine's prefill
    rate (`speed`, which the engine learns; a controller of its own when not given)."""

    def __init__(self, config: ControllerConfig = ControllerConfig(), speed: EngineSpeed | None = None) -> None:
        self.config = config
        self.speed = speed if speed is not None else EngineSpeed()

    @property
    def tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s

    def decide(self, store, keys: Sequence, tokens: Sequence[int]) -> list[ChunkDecision]:
        """Read or compute each chunk (`keys[i]` of `tokens[i]` tokens) of one request.

        Args:
            store: a kvstore.TieredStore (`where_many`, `read_estimate`, `prefetch_workers`).
        """
        rate = self.tokens_per_s
        base = []
        for n, tier in zip(tokens, store.where_many(keys)):
            est = store.read_estimate(tier) if tier is not None else None
            base.append(ChunkDecision(tier is not None, KVSource.LOADED if tier is not None
                                      else KVSource.COMPUTED_MISSING, tier,
                                      est.seconds(n) if est is not None else None, n / rate if rate else None))
        readable = [i for i, d in enumerate(base) if d.load]
        if not self.config.enabled or any(base[i].load_s is None or base[i].compute_s is None for i in readable):
            return base
        workers = max(1, getattr(store, "prefetch_workers", 1))
        compute = {i for i, d in enumerate(base) if not d.load}
        missing_s = sum(base[i].compute_s or 0.0 for i in compute)

        def ready_s(computed: set[int]) -> float:
            read_s = _reads_s([base[i].load_s for i in readable if i not in computed], workers)
            return max(read_s, self.config.margin * (missing_s + sum(base[i].compute_s for i in computed)))

        slowest_first = sorted(readable, key=lambda i: base[i].load_s, reverse=True)
        # compute the k slowest reads, for the k that makes the KV ready soonest (fewest on ties)
        k = min(range(len(slowest_first) + 1), key=lambda k: (ready_s(set(slowest_first[:k])), k))
        chosen = set(slowest_first[:k])
        return [ChunkDecision(False, KVSource.COMPUTED_CHEAPER, d.tier, d.load_s, d.compute_s) if i in chosen else d
                for i, d in enumerate(base)]

    def prefers_full(self, decisions: Sequence[ChunkDecision], mode: Mode, prompt_tokens: int,
                     workers: int = 1, layered: bool = True) -> bool:
        """Whether full prefill of the `prompt_tokens` gives the first token sooner than the chunk
        plan `decisions` followed by `mode`'s pass, by the engine's measured rates: by
        `full_factor` and `full_floor_s` at least. Never while a rate or a tier is unmeasured, nor
        when a chunk is in no tier (computing it writes its KV back for the next request).

        The chunk plan is ready when its reads (in rounds of `workers`) and its computes (one after
        another, `margin` times) are done; with `layered` reads the pass runs as layers arrive."""
        mode = Mode(mode)
        if not self.config.enabled or mode is Mode.FULL or not decisions:
            return False
        full_rate, mode_rate = self.speed.prompt_tokens_per_s(Mode.FULL), self.speed.prompt_tokens_per_s(mode)
        loads = [d.load_s for d in decisions if d.load]
        computes = [d.compute_s for d in decisions if not d.load]
        if (not full_rate or not mode_rate or any(s is None for s in (*loads, *computes))
                or any(d.tier is None for d in decisions)):
            return False
        read_s = _reads_s(loads, workers)  # type: ignore[arg-type]
        compute_s = self.config.margin * sum(computes)  # type: ignore[arg-type]
        pass_s = self.config.margin * prompt_tokens / mode_rate
        ready_s = max(read_s, compute_s + pass_s) if layered else max(read_s, compute_s) + pass_s
        full_s = self.config.margin * prompt_tokens / full_rate
        return full_s * self.config.full_factor + self.config.full_floor_s < ready_s

    def wait_limit(self, decisions: Sequence[ChunkDecision], hard_limit_s: float, workers: int = 1) -> float:
        """Seconds to wait for the chosen reads before the pending ones race their chunks'
        compute: their estimated time (in rounds of `workers` at once) times `overrun_factor`,
        plus the floor. While a read is unmeasured (a tier's first reads), the time computing
        those chunks would take (`margin` times), plus the floor: a read slower than that never
        keeps a request waiting longer. `hard_limit_s` while neither is known."""
        chosen = [d for d in decisions if d.load]
        if not self.config.enabled or not chosen:
            return hard_limit_s
        floor = self.config.overrun_floor_s
        if all(d.load_s is not None for d in chosen):
            read_s = _reads_s([d.load_s for d in chosen], workers)  # type: ignore[misc]
            return min(hard_limit_s, read_s * self.config.overrun_factor + floor)
        if all(d.compute_s is not None for d in chosen):
            return min(hard_limit_s, self.config.margin * sum(d.compute_s for d in chosen) + floor)  # type: ignore[misc]
        return hard_limit_s


def _reads_s(loads: Sequence[float], workers: int) -> float:
    """Seconds until every read of `loads` (estimated seconds each) is done, `workers` at a time:
    rounds of the slowest."""
    return max(loads) * math.ceil(len(loads) / max(1, workers)) if loads else 0.0
