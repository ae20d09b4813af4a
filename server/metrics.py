"""Prometheus metrics of the query server, in their own registry, served on their own port."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ragkv.types import Mode, RetrievedChunk, Tier

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FRACTION_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
# Tiers that can answer a KV lookup, top first.
_CACHE_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.S3)


class ServerMetrics:
    """Every metric the server exports.

    Args:
        registry: Where the metrics live; a fresh one by default, so several servers
            (tests) in one process do not collide.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ragkv_ttft_seconds", "Request arrival to first token.", ["mode"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ragkv_request_seconds", "Request arrival to the end of the response.", ["method"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.recompute = Histogram(
            "ragkv_recompute_fraction", "Fraction of prompt tokens recomputed.", ["mode"],
            buckets=_FRACTION_BUCKETS, registry=r,
        )
        self.tier_hits = Counter("ragkv_kv_tier_hits", "Chunk KVs found in a tier.", ["tier"], registry=r)
        self.tier_misses = Counter(
            "ragkv_kv_tier_misses", "Chunk KVs a tier did not hold (found lower, or computed).", ["tier"],
            registry=r,
        )
        self.kv_computed = Counter("ragkv_kv_computed", "Chunk KVs missing from every tier, computed.", registry=r)
        self.bytes_loaded = Counter("ragkv_kv_bytes_loaded", "KV bytes loaded per tier.", ["tier"], registry=r)
        self.queue_depth = Gauge("ragkv_queue_depth", "Queries admitted and not finished.", registry=r)
        self.errors = Counter("ragkv_rpc_errors", "RPCs that ended with a non-OK status.", ["method", "code"], registry=r)

    def observe_chunks(self, chunks: tuple[RetrievedChunk, ...]) -> None:
        """Count tier hits and misses of one request's chunk KVs."""
        for chunk in chunks:
            tier = chunk.kv_tier
            if tier in _CACHE_TIERS:
                self.tier_hits.labels(tier.value).inc()
                for above in _CACHE_TIERS[: _CACHE_TIERS.index(tier)]:
                    self.tier_misses.labels(above.value).inc()
            elif tier is Tier.COMPUTED:
                self.kv_computed.inc()
                for above in _CACHE_TIERS:
                    self.tier_misses.labels(above.value).inc()

    def observe_answer(
        self, mode: Mode, ttft: float | None, recompute_fraction: float, bytes_loaded: Mapping[Tier, int]
    ) -> None:
        """Record one finished answer."""
        if ttft is not None:
            self.ttft.labels(mode.value).observe(ttft)
        self.recompute.labels(mode.value).observe(recompute_fraction)
        for tier, n in bytes_loaded.items():
            self.bytes_loaded.labels(tier.value).inc(n)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        """Stop the /metrics endpoint, if serving."""
        httpd = getattr(self, "_httpd", None)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            self._httpd = None
