"""Prometheus metrics of the query server, in their own registry, served on their own port.

Names follow Prometheus conventions: counters end in `_total` (prometheus_client adds it),
units are spelled out (`_seconds`, `_bytes`), fractions end in `_ratio`. Per-request
metrics carry a `collection` label, so one server's indexes can be told apart. The gRPC
and the HTTP API record into the same objects (the `method` label tells them apart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ragkv.server.fidelity import ServedRatio
from ragkv.types import DEFAULT_COLLECTION, FocusSignal, KVSource, Mode, RetrievedChunk, Tier

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FRACTION_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
# Tiers that can answer a KV lookup, top first.
_CACHE_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.PEER, Tier.S3)
# the replicas' peer tier counters (their routing summaries' gauges), exported as counters too
_PEER_COUNTERS = {
    "peer_reads": "Chunk KVs read from another replica through the object store (`ragkv serve --replicas`).",
    "peer_read_bytes": "Bytes of chunk KV read from other replicas.",
    "peer_read_seconds": "Seconds spent reading chunk KV from other replicas (lookups, misses included).",
    "peer_misses": "Peer tier lookups that found no readable copy (the chunk was read lower or computed).",
    "peer_errors": "Peer reads that failed: a copy lost with its replica, past its deadline, or no directory.",
    "peer_rejected": "Peer copies refused by their checksums (the chunk was read lower or computed).",
}


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
            "ragkv_ttft_seconds", "Request arrival to first token.", ["mode", "collection"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ragkv_request_seconds", "Request arrival to the end of the response.", ["method"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.recompute = Histogram(
            "ragkv_recompute_ratio", "Fraction of prompt tokens recomputed.", ["mode", "collection"],
            buckets=_FRACTION_BUCKETS, registry=r,
        )
        self.tier_hits = Counter("ragkv_kv_tier_hits", "Chunk KVs found in a tier.", ["tier", "collection"],
                                 registry=r)
        self.tier_misses = Counter(
            "ragkv_kv_tier_misses", "Chunk KVs a tier did not hold (found lower, or computed).", ["tier", "collection"],
            registry=r,
        )
        self.kv_computed = Counter("ragkv_kv_computed", "Chunk KVs missing from every tier, computed.",
                                   ["collection"], registry=r)
        self.bytes_loaded = Counter("ragkv_kv_loaded_bytes", "KV bytes loaded per tier.", ["tier", "collection"],
                                    registry=r)
        self.kv_sources = Counter(
            "ragkv_chunk_kv", "Chunk KVs by where they came from, as the loading controller decided: loaded, "
            "computed_missing, computed_cheaper, computed_overrun, computed_failed (exported as _total).",
            ["source", "collection"], registry=r)
        self.fallbacks = Counter(
            "ragkv_quality_fallbacks", "Answers the quality guard ran as full prefill (--quality-guard-mass), by "
            "the mode asked for; over ragkv_answers_total that is the fallback rate (exported as _total).",
            ["mode", "collection"], registry=r)
        self.handovers = Counter(
            "ragkv_focus_handovers", "Focus answers that blended every chunk because several mattered "
            "(--focus-handover, --focus-spread); the rest of focus's answers were lookups over the chunks "
            "it kept (exported as _total).", ["collection"], registry=r)
        self.focus_kept_attention = Histogram(
            "ragkv_focus_kept_attention_ratio", "Focus answers: the share of the question's attention onto the "
            "chunks that the chunks answered over hold (1 for a handover, which drops none; a lookup near 1 kept "
            "what the question reads), by decision (handed_over true or false).",
            ["handed_over", "collection"], buckets=(0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=r)
        self.focus_spread = Histogram(
            "ragkv_focus_spread_ratio", "Focus answers: the two runners-up chunks' mean score over the best "
            "(the handover rule's input: a lookup far below --focus-spread was a sure one).",
            ["handed_over", "collection"], buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.66, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.answers = Counter("ragkv_answers", "Answers completed, by mode (exported as _total).",
                               ["mode", "collection"], registry=r)
        self.queue_depth = Gauge("ragkv_queue_depth", "Queries admitted and not finished.", registry=r)
        self.served_ratio = Gauge("ragkv_served_recompute_ratio", "Blend's recompute ratio for a request that sets "
                                  "none, per collection (its calibration's choice at --fidelity-kl).", ["collection"],
                                  registry=r)
        self.served_kl = Gauge("ragkv_served_predicted_kl", "The next-token KL to full prefill the collection's "
                               "calibration predicts at that ratio; NaN: the index has no calibration.", ["collection"],
                               registry=r)
        self.errors = Counter("ragkv_rpc_errors", "RPCs that ended with a non-OK status.", ["method", "code"], registry=r)
        # the scheduler (engine.scheduler): batching and throughput
        self.requests_running = Gauge("ragkv_requests_running", "Queries in a prompt pass or decoding.", registry=r)
        self.requests_waiting = Gauge("ragkv_requests_waiting", "Queries admitted, not started.", registry=r)
        self.batch_size = Histogram("ragkv_decode_batch_size", "Queries decoded together in one step.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.time_per_output_token = Histogram(
            "ragkv_time_per_output_token_seconds", "Seconds of one batched decode step.",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0), registry=r)
        self.prompt_layer_passes = Histogram(
            "ragkv_prompt_layer_passes", "Prompt passes whose same layer ran in one prompt step (--prompt-batch-rows).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.generation_tokens = Counter("ragkv_generation_tokens", "Tokens generated (exported as _total).",
                                         ["collection"], registry=r)
        self.prompt_tokens = Counter("ragkv_prompt_tokens", "Prompt tokens, by whether their KV came from a cache "
                                     "(exported as _total).", ["cached", "collection"], registry=r)
        self.requests = Counter("ragkv_requests", "Query RPCs by final status code (exported as _total).",
                                ["code"], registry=r)
        # per API key (server.api_keys; "-" on an open server): who asks how much
        self.key_requests = Counter("ragkv_key_requests", "Requests by API key name and method, counted when "
                                    "authenticated (exported as _total).", ["key", "method"], registry=r)
        self.key_refusals = Counter("ragkv_key_refusals", "Requests refused by API key name and status code: "
                                    "PERMISSION_DENIED, RESOURCE_EXHAUSTED (exported as _total).", ["key", "code"],
                                    registry=r)
        self.key_prompt_tokens = Counter("ragkv_key_prompt_tokens", "Prompt tokens answered, by API key name "
                                         "(exported as _total).", ["key"], registry=r)

    def observe_prompt_layer(self, passes: int, rows: int) -> None:
        """One prompt step's layer, run for `passes` passes at once (engine.scheduler's hook)."""
        self.prompt_layer_passes.observe(passes)

    def observe_step(self, batch: int, seconds: float) -> None:
        """One batched decode step (engine.scheduler's hook)."""
        self.batch_size.observe(batch)
        self.time_per_output_token.observe(seconds)

    def watch_scheduler(self, stats) -> None:  # engine.scheduler.SchedulerStats
        """Read the running/waiting gauges from the scheduler and take its step hook."""
        self.requests_running.set_function(lambda: stats.running)
        self.requests_waiting.set_function(lambda: stats.waiting)
        stats.on_step.append(self.observe_step)
        stats.on_prompt_layer.append(self.observe_prompt_layer)

    def observe_usage(self, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
                      collection: str = DEFAULT_COLLECTION) -> None:
        """Token counts of one finished answer."""
        self.prompt_tokens.labels("true", collection).inc(cached_prompt_tokens)
        self.prompt_tokens.labels("false", collection).inc(prompt_tokens - cached_prompt_tokens)
        self.generation_tokens.labels(collection).inc(completion_tokens)

    def observe_chunks(self, chunks: tuple[RetrievedChunk, ...], collection: str = DEFAULT_COLLECTION) -> None:
        """Count tier hits and misses of one request's chunk KVs."""
        for chunk in chunks:
            tier = chunk.kv_tier
            if tier in _CACHE_TIERS:
                self.tier_hits.labels(tier.value, collection).inc()
                for above in _CACHE_TIERS[: _CACHE_TIERS.index(tier)]:
                    self.tier_misses.labels(above.value, collection).inc()
            elif tier is Tier.COMPUTED:
                self.kv_computed.labels(collection).inc()
                for above in _CACHE_TIERS:
                    self.tier_misses.labels(above.value, collection).inc()

    def observe_answer(
        self, mode: Mode, ttft: float | None, recompute_fraction: float, bytes_loaded: Mapping[Tier, int],
        collection: str = DEFAULT_COLLECTION, kv_sources: Mapping[KVSource, int] | None = None,
        fell_back: bool = False, handed_over: bool = False, focus: FocusSignal | None = None,
    ) -> None:
        """Record one finished answer (`focus`: focus's decision, when it ran)."""
        self.answers.labels(mode.value, collection).inc()
        if focus is not None:
            decided = "true" if focus.handed_over else "false"
            self.focus_kept_attention.labels(decided, collection).observe(focus.kept_attention)
            self.focus_spread.labels(decided, collection).observe(focus.spread)
        if fell_back:
            self.fallbacks.labels(mode.value, collection).inc()
        if handed_over:
            self.handovers.labels(collection).inc()
        if ttft is not None:
            self.ttft.labels(mode.value, collection).observe(ttft)
        self.recompute.labels(mode.value, collection).observe(recompute_fraction)
        for tier, n in bytes_loaded.items():
            self.bytes_loaded.labels(tier.value, collection).inc(n)
        for source, n in (kv_sources or {}).items():
            self.kv_sources.labels(source.value, collection).inc(n)

    def watch_tier_errors(self, read: Callable[[], Mapping[tuple[str, Tier], int]]) -> None:
        """Export `read()`'s I/O failures per (collection, tier) as ragkv_kv_tier_errors_total
        (an S3 endpoint down, a disk that cannot be read); read at each scrape."""
        self.registry.register(_TierErrors(read))

    def observe_served(self, served: Mapping[str, ServedRatio]) -> None:
        """Each collection's ratio for requests that set none, and the KL predicted for it (set once loaded)."""
        for name, s in served.items():
            self.served_ratio.labels(name).set(s.ratio)
            self.served_kl.labels(name).set(float("nan") if s.predicted_kl is None else s.predicted_kl)

    def watch_kv_tree(self, read: Callable[[], object]) -> None:
        """Export the KV tree's counters (`read()` -> engine.kv.tree.TreeStats) at each scrape:
        ragkv_kv_tree_hits_total, _hit_tokens_total, _misses_total, _evictions_total,
        _evicted_bytes_total, _spills_total, _spilled_hit_tokens_total, _restored_total,
        _read_errors_total, _warmed_tokens_total, _reads_skipped_total, and the gauges
        ragkv_kv_tree_bytes, _budget_bytes, _nodes and each lower tier's _host_bytes,
        _host_budget_bytes, _disk_bytes, _disk_budget_bytes."""
        self.registry.register(_KVTree(read))

    def watch_decoder(self, read: Callable[[], object], pool: Callable[[], object] | None = None) -> None:
        """Export the pooled decoder's counts (`read()` -> engine.decode_graphs.DecodeStats) at each
        scrape: ragkv_decode_steps_total{path="graph"|"eager"|"ragged"} (replayed graphs, pooled steps
        run eagerly, steps with rows the pool could not hold), ragkv_decode_pool_evictions_total,
        ragkv_decode_graph_captures_total,
        ragkv_decode_graph_capture_failures_total and ragkv_decode_graph_capture_seconds_total; and
        with `pool()` (-> engine.kv.decode_pool.DecodePool) how KV moved between requests and the
        KV tree in it: ragkv_decode_pool_kv_tokens_total{how="lent"|"handed"|"copied"|"relocated"|
        "reclaimed"|"rehomed"} (a leased path read in place, an insert taken in place, tokens
        copied into a run, the tree's tokens moved out of a lent path's way, or down a tier to
        make room for a run, or kept in a request's copy of them) and the gauges
        ragkv_decode_pool_tokens{holder="requests"|"tree"} and ragkv_decode_pool_capacity_tokens."""
        self.registry.register(_Decoder(read, pool))

    def watch_routing(self, read: Callable[[], tuple[Mapping[str, int], Mapping[str, Mapping[str, float]]]]) -> None:
        """Export the cluster router's decisions and the replicas' own gauges at each scrape
        (`read()` -> (decisions by reason, {replica: {gauge: value}}), server/routing.py's
        `RouterViews.read`): ragkv_route_decisions_total{reason} and, per replica as it last
        published (seconds old), ragkv_replica_<gauge>{replica} (backlog_seconds, queue,
        requests_running, kv_tree_bytes, tier_chunks_cpu, ...)."""
        self.registry.register(_Routing(read))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
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


class _TierErrors:
    """A collector of the KV tiers' own error counts (kept by kvstore, read at scrape time)."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, Tier], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("ragkv_kv_tier_errors", "KV tier I/O failures (each a miss or a failed "
                                     "write; the request is served from another tier or computed).",
                                     labels=["tier", "collection"])
        for (collection, tier), n in sorted(self._read().items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            family.add_metric([tier.value, collection], n)
        yield family


class _Decoder:
    """A collector of the pooled decoder's counts (kept by the engine, read at scrape time)."""

    def __init__(self, read: Callable[[], object], pool: Callable[[], object] | None = None) -> None:
        self._read = read
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        if self._pool is not None:
            yield from self._moves(self._pool())
        steps = CounterMetricFamily("ragkv_decode_steps", "Decode steps by path: a replayed CUDA graph, a pooled "
                                    "step run eagerly, or ragged decode (rows the pool could not hold: a step "
                                    "may count under two paths).", labels=["path"])
        for path in ("graph", "eager", "ragged"):
            steps.add_metric([path], getattr(stats, f"{path}_steps"))
        yield steps
        yield CounterMetricFamily("ragkv_decode_pool_evictions", "Requests whose run in the decode pool could not "
                                  "grow: their KV copied out, decoding ragged until a run is free.",
                                  value=stats.left_pool)
        yield CounterMetricFamily("ragkv_decode_graph_captures", "Decode steps captured as CUDA graphs "
                                  "(one per batch and key bucket).", value=stats.captures)
        yield CounterMetricFamily("ragkv_decode_graph_capture_failures", "Buckets whose capture failed "
                                  "(they run eagerly).", value=stats.capture_failures)
        yield CounterMetricFamily("ragkv_decode_graph_capture_seconds", "Seconds spent capturing decode graphs.",
                                  value=stats.capture_s)

    @staticmethod
    def _moves(pool: object) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        moved = CounterMetricFamily("ragkv_decode_pool_kv_tokens", "Tokens of KV between requests and the KV tree in "
                                    "the decode pool: a leased path lent in place, an insert handed in place, "
                                    "KV copied into a run, the tree's KV moved out of a lent path's way, the "
                                    "tree's KV moved down a tier to make room for a request's run, the tree's KV "
                                    "kept in a request's copy of it (its own slots given back).",
                                    labels=["how"])
        for how, attr in (("lent", "borrowed_tokens"), ("handed", "handed_tokens"), ("copied", "copied_tokens"),
                          ("relocated", "relocated_tokens"), ("reclaimed", "reclaimed_tokens"),
                          ("rehomed", "rehomed_tokens")):
            moved.add_metric([how], getattr(pool, attr))
        yield moved
        held = GaugeMetricFamily("ragkv_decode_pool_tokens", "Token slots of the decode pool held now, by holder.",
                                 labels=["holder"])
        tree = pool.tree_tokens
        held.add_metric(["requests"], pool.used - tree)
        held.add_metric(["tree"], tree)
        yield held
        yield GaugeMetricFamily("ragkv_decode_pool_capacity_tokens", "Token slots of the decode pool (requests "
                                "and the KV tree).", value=pool.capacity)


class _KVTree:
    """A collector of the KV tree's own counts (kept by the engine, read at scrape time)."""

    _COUNTERS = (("hits", "Requests whose prompt began with a context the KV tree held."),
                 ("hit_tokens", "Prompt tokens whose KV came from the KV tree."),
                 ("misses", "Requests whose context the KV tree did not hold."),
                 ("evictions", "KV tree nodes evicted to keep its byte budget."),
                 ("evicted_bytes", "KV bytes evicted from the KV tree."),
                 ("spills", "KV tree nodes moved down a tier (device to host, host to disk)."),
                 ("spilled_hit_tokens", "Prompt tokens whose KV the KV tree read back from its host or disk tier."),
                 ("restored", "KV tree nodes found on disk at start (a restart's conversations)."),
                 ("read_errors", "Spilled KV tree nodes that could not be read (their tokens were computed)."),
                 ("warmed_tokens", "Tokens the KV tree brought from disk to CPU memory ahead of their "
                                   "conversation's next call (read while it retrieved)."),
                 ("reads_skipped", "Spilled KV tree nodes on disk not read at a match: computing their tokens "
                                   "was sooner by the measured rates."))
    _GAUGES = (("nbytes", "bytes", "KV bytes the KV tree holds on the engine's device."),
               ("budget_bytes", "budget_bytes", "The KV tree's byte budget (--kv-tree-bytes)."),
               ("nodes", "nodes", "Nodes of the KV tree."),
               ("host_bytes", "host_bytes", "KV bytes the KV tree keeps in CPU memory."),
               ("host_budget_bytes", "host_budget_bytes", "The KV tree's host budget (--kv-tree-host-bytes)."),
               ("disk_bytes", "disk_bytes", "KV bytes the KV tree keeps on disk."),
               ("disk_budget_bytes", "disk_budget_bytes", "The KV tree's disk budget (--kv-tree-disk-bytes)."))

    def __init__(self, read: Callable[[], object]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        for name, doc in self._COUNTERS:
            yield CounterMetricFamily(f"ragkv_kv_tree_{name}", doc, value=getattr(stats, name))
        for attr, name, doc in self._GAUGES:
            yield GaugeMetricFamily(f"ragkv_kv_tree_{name}", doc, value=getattr(stats, attr))


class _Routing:
    """A collector of the router's decisions and the replicas' gauges (the ingress's view)."""

    def __init__(self, read: Callable[[], tuple[Mapping[str, int], Mapping[str, Mapping[str, float]]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        decisions, replicas = self._read()
        family = CounterMetricFamily(
            "ragkv_route_decisions", "Routing decisions by why the replica was chosen: held (it holds more of the "
            "request), home (its chunk set's rendezvous home), overflow (a busier holder or home passed over: a "
            "hot set warms a second replica), pinned (the conversation's last replica), balanced, pow2.",
            labels=["reason"])
        for reason, n in sorted(decisions.items()):
            family.add_metric([reason], n)
        yield family
        names = sorted({name for gauges in replicas.values() for name in gauges})
        for name in (n for n in names if n in _PEER_COUNTERS):
            counter = CounterMetricFamily(f"ragkv_{name}", _PEER_COUNTERS[name], labels=["replica"])
            for replica, gauges in sorted(replicas.items()):
                if name in gauges:
                    counter.add_metric([replica], gauges[name])
            yield counter
        for name in names:
            gauge = GaugeMetricFamily(f"ragkv_replica_{name}", f"Each engine replica's {name.replace('_', ' ')}, as "
                                      "it last published it to the router (seconds old).", labels=["replica"])
            for replica, gauges in sorted(replicas.items()):
                if name in gauges:
                    gauge.add_metric([replica], gauges[name])
            yield gauge
