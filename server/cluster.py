"""`ragkv serve --replicas N`: the same server as Ray Serve deployments, routed by chunks.

    clients ──gRPC──► Ray Serve gRPC proxy ─┐
    clients ──HTTP──► Ray Serve HTTP proxy ─┴─► Ingress (retrieve, route keys)
                                                   │ handle.answer (streamed), ChunkRouter
                                 ┌─────────────────┼─────────────────┐
                             EngineReplica     EngineReplica     EngineReplica
                             GPU/CPU/disk tiers, KV tree, scheduler (one per GPU)
                                 └────────── shared S3 (or disk) tier ─┘

- `Ingress` serves today's gRPC service (through Ray Serve's gRPC proxy: the methods of
  `ragkv.v1.RagService` and `grpc.health.v1.Health`) and the OpenAI HTTP API (its ASGI app,
  through the HTTP proxy). It validates and retrieves, so the chunk keys are known before
  routing, then streams the answer from a replica (`RoutedRunner`).
- `EngineReplica` is one engine with its own tiers over the shared durable ones: the same
  `Pipeline`, scheduler and `QueryRunner` as one process, given the ingress's hits. It
  publishes what its tiers and KV tree hold (`record_routing_stats`: Bloom filters, never
  key lists) and its queue.
- `ChunkRouter` is Ray Serve's `RequestRouter` over `server/routing.py`'s pure scoring.
  Each replica's answer begins with `Answering` (which replica it is); the ingress pins the
  conversation there (`ConversationPins`), so its next call (a chat's next turn, a Responses
  request's `previous_response_id`) goes back to the replica whose KV tree holds it while
  that replica is alive, and routes as any other request once it is gone.

Faults: a request whose replica dies before its first token is sent to another replica
(its chunks are held back until then, so the client sees one answer); one that dies
mid-answer ends UNAVAILABLE (`ReplicaLostError`). Ray Serve restarts the replica.

Only `ragkv serve --replicas` imports this module (the `ray` extra); one process never does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig, gRPCOptions
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ragkv.engine.scheduler import Scheduler
from ragkv.kvstore.key_filter import KeyFilter
from ragkv.server import ray_proxy, routing
from ragkv.server.admission import Admission
from ragkv.server.answering import ChunksEvent, QueryRunner, RunEvent
from ragkv.server.backend import BackendParts, Catalogue
from ragkv.server.metrics import ServerMetrics
from ragkv.server.query import Query
from ragkv.server.routing import (
    ROUTE_SLACK,
    ConversationPins,
    KeyHex,
    Policy,
    ReplicaSummary,
    ReplicaView,
    RouteKeys,
    Speeds,
    note_routed,
    route,
)
from ragkv.server.service import RagService
from ragkv.server.settings import ServerSettings
from ragkv.server.status import NotServingError, ReplicaLostError, UnknownCollectionError
from ragkv.types import (
    CollectionInfo,
    CollectionStats,
    MetadataFilter,
    Mode,
    QueryStats,
    RetrievedChunk,
    SearchMode,
    Tier,
)
from ragkv.v1 import ragkv_pb2 as pb

if TYPE_CHECKING:  # the retriever loads FAISS: imported on the ingress when it runs
    from ragkv.retriever import Retriever, SearchHit

log = logging.getLogger(__name__)

APP_NAME = "ragkv"
_SERVICER_FUNCTIONS = (
    "ragkv.v1.ragkv_pb2_grpc.add_RagServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
    ray_proxy.GUARD,  # last: after Ray's own service, which it makes refuse ListApplications
)
PROXY_READY_S = 30.0  # how long Serve's controller waits for a proxy to start (Ray's default: 5 s)
_CONVERSATIONS_KEPT = 4096  # conversation ids a replica remembers serving (published as a Bloom filter)


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """How `ragkv serve --replicas` lays the server out on Ray."""

    replicas: int  # engine replicas (one per GPU; per process on a CPU host)
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); None = a local one
    routing: Policy = Policy.CHUNK  # how the ingress picks a replica
    # prompt passes a replica's expected time to first token may exceed the soonest replica's
    # and still be chosen for what it holds (`routing.route`): higher keeps chunk sets together,
    # lower spreads load sooner
    route_slack: float = ROUTE_SLACK
    stats_period_s: float = 1.0  # seconds between a replica's routing summaries
    retries: int = 2  # replicas a request that has not begun is sent to after its first one fails
    cpus_per_replica: float = 1.0  # Ray CPUs each engine replica takes (CPU hosts)
    gpus_per_replica: float = 0.0  # Ray GPUs each engine replica takes (1 on GPU hosts)
    # the pooled tier: each replica publishes the chunk KV it computes or reads from S3 to Ray's
    # object store, and reads what the others published before S3 (`kvstore.tiers.peer`)
    peer_tier: bool = True
    peer_tier_bytes: int | None = None  # bytes each replica publishes at most; None = its --kv-cpu-bytes
    peer_timeout_s: float = 2.0  # a directory lookup, and a peer read, give up after this (a miss)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if not self.route_slack >= 0:
            raise ValueError(f"route_slack must be >= 0, got {self.route_slack!r}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.peer_tier_bytes is not None and self.peer_tier_bytes <= 0:
            raise ValueError(f"peer_tier_bytes must be > 0, got {self.peer_tier_bytes!r}")
        if not self.peer_timeout_s > 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {self.peer_timeout_s!r}")

    def peer(self, settings: ServerSettings) -> PeerSettings | None:
        """What each replica's peer tier takes; None when the tier is off (or one replica has no peers)."""
        if not self.peer_tier or self.replicas < 2:
            return None
        return PeerSettings(self.peer_tier_bytes or settings.kv_cpu_bytes, self.peer_timeout_s)


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """A replica's peer tier (`ClusterSettings.peer`)."""

    budget_bytes: int  # what it publishes at most, over all its collections
    timeout_s: float  # a lookup or a read gives up after this


# -- what crosses from the ingress to a replica ---------------------------------------------

@dataclass(frozen=True, slots=True)
class Asked:
    """A validated query as it travels to a replica: the query itself, and its time left."""

    query: Query  # frozen and picklable: the replica prepares its engine request from it
    seconds_left: float | None  # until its deadline (a monotonic clock is per host); None = none

    @classmethod
    def of(cls, query: Query, deadline: float | None) -> Asked:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return cls(query, left)

    def deadline(self) -> float | None:
        return None if self.seconds_left is None else time.monotonic() + self.seconds_left


@dataclass(frozen=True, slots=True)
class Answering:
    """A replica's first event of an answer: which replica it is (the ingress pins the
    conversation there; it never reaches a client)."""

    replica: str  # Ray Serve's unique id of the replica (`ReplicaID.unique_id`, the router's view id)


def route_keys(query: Query, keys: Sequence[str], tokens: Sequence[int] = ()) -> RouteKeys:
    """What routing looks for: the chunks' KV keys, best first (their tokens), and the
    conversation the query continues."""
    return RouteKeys(tuple(KeyHex(k) for k in keys), query.conversation, tokens=tuple(tokens))


# -- the engine replica ---------------------------------------------------------------------


class EngineReplica:
    """One engine with its own tiers: the one-process server's parts without its gRPC server."""

    def __init__(self, settings: ServerSettings, peer: PeerSettings | None = None) -> None:
        from ragkv.engine.host_threads import compute_on_one_thread
        from ragkv.server.assembly import build_pipeline, fetch_indexes

        compute_on_one_thread()  # its scheduler's thread computes on the replica's cores, the rest on one
        logging.basicConfig(level=settings.log_level)
        fetch_indexes(settings)  # an s3:// index, synced onto this replica's host
        self.settings = settings
        self.metrics = ServerMetrics()
        self._admission = Admission(settings.max_queue, self.metrics.queue_depth.set)
        self._pool = ThreadPoolExecutor(settings.retrieve_workers, thread_name_prefix="ragkv-retrieve")
        self._scheduler = Scheduler(settings.scheduler())
        self.pipeline = build_pipeline(settings)
        engine = self.pipeline.engine
        self._scheduler.share_engine(engine.conversations.tree, engine.speed, engine.decoder)
        self._runner = QueryRunner(admission=self._admission, metrics=self.metrics, retrieve_pool=self._pool,
                                   scheduler=self._scheduler)
        self._conversations: OrderedDict[str, None] = OrderedDict()
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._lock = threading.Lock()
        self._filters: dict[Tier, tuple[frozenset[str], KeyFilter]] = {}  # per tier: the keys it was built from
        if peer is not None:
            self._join_peers(peer)

    def _join_peers(self, peer: PeerSettings) -> None:
        """Attach a peer tier to each collection's store (the budget split between them)."""
        from ragkv.kvstore import PeerTier
        from ragkv.kvstore.tiers.peer_ray import RayDirectory, RayObjects, find_directory

        actor = find_directory()
        if actor is None:
            log.warning("the peer tier is on but no peer directory runs: this replica reads no peers")
            return
        stores = self.pipeline.stores()
        directory, objects = RayDirectory(actor, peer.timeout_s), RayObjects()
        for store in stores:
            store.attach(PeerTier(self._replica, directory, objects, store.model_fp, store.tokenizer_fp,
                                  max(1, peer.budget_bytes // len(stores)), store.compression,
                                  read_timeout_s=peer.timeout_s))

    async def answer(self, asked: Asked, hits: Sequence[SearchHit],
                     route: RouteKeys) -> AsyncIterator[Answering | RunEvent]:
        """Answer a query the ingress validated and retrieved for (`route` is the router's):
        `Answering` first, then the answer's events."""
        if route.conversation is not None:
            with self._lock:
                self._conversations[route.conversation] = None
                self._conversations.move_to_end(route.conversation)
                while len(self._conversations) > _CONVERSATIONS_KEPT:
                    self._conversations.popitem(last=False)
        cancel = threading.Event()
        yield Answering(self._replica)
        try:
            async for event in self._runner.run(self.pipeline, asked.query, arrived=time.perf_counter(), cancel=cancel,
                                                deadline=asked.deadline(), hits=hits):
                yield event
        finally:
            cancel.set()

    def collection_stats(self, name: str) -> CollectionStats:
        return self.pipeline.collection_stats(name)

    def _filter(self, tier: Tier, keys: set[str]) -> KeyFilter:
        """A tier's Bloom filter, built again only when its keys changed (a disk tier holds many
        and mostly keeps them: hashing each every stats period would cost the engine's CPU)."""
        held = frozenset(keys)
        cached = self._filters.get(tier)
        if cached is None or cached[0] != held:
            cached = self._filters[tier] = (held, KeyFilter.of(held))
        return cached[1]

    def record_routing_stats(self) -> dict[str, Any]:
        """What this replica holds, for the router (Ray Serve calls it every stats period)."""
        with self._lock:
            conversations = list(self._conversations)
        held = self.pipeline.held_keys()
        engine, st = self.pipeline.engine, self._scheduler.stats
        rate = engine.speed.tokens_per_s
        speeds = Speeds(self.pipeline.read_speeds(), 1.0 / rate if rate else None, engine.speed.pass_s, st.backlog_s)
        tree = engine.conversations.tree.stats()
        gauges = {"backlog_seconds": st.backlog_s, "requests_running": st.running, "requests_waiting": st.waiting,
                  "requests_waiting_kv": st.waiting_kv, "kv_bytes_in_flight": st.kv_bytes,
                  "kv_tree_bytes": tree.nbytes, "kv_tree_host_bytes": tree.host_bytes,
                  "kv_tree_disk_bytes": tree.disk_bytes, "kv_tree_hits": tree.hits,
                  **self.pipeline.peer_counters(),
                  **{f"tier_chunks_{tier.value}": len(keys) for tier, keys in held.items()}}
        summary = ReplicaSummary({tier: self._filter(tier, keys) for tier, keys in held.items()},
                                 KeyFilter.of(conversations), self._admission.depth, speeds, gauges)
        return {**summary.to_dict(), "at": time.time()}


# -- the router ------------------------------------------------------------------------------


class ChunkRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router for engine replicas: `server/routing.py`'s ranking over the
    replicas' published summaries, updated by what it routes until their next summary."""

    def initialize_state(self, policy: str = Policy.CHUNK.value, slack: float = ROUTE_SLACK,
                         peers: bool = False) -> None:
        self._policy = Policy(policy)
        self._slack = slack
        self._peers = peers  # the replicas read each other's host tiers: price a peer's chunk as a peer read
        self._views: dict[ReplicaID, ReplicaView] = {}
        routing.ROUTER_VIEWS.routers.add(self)  # the ingress's metrics read it (`routing.RouterViews`)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        view = self._views.setdefault(replica.replica_id, ReplicaView(replica.replica_id.unique_id))
        view.absorb(ReplicaSummary.from_dict(stats), float(stats.get("at", 0.0)))
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        view.queue = view.summary.queue if cached is None else cached
        return view

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = _keys_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = route([self._view(r) for r in candidate_replicas], keys, self._policy, slack=self._slack,
                        peers=self._peers)
        routing.ROUTER_VIEWS.decided(ranking.reason)
        return [[by_id[v.replica_id]] for v in ranking.replicas]

    def views(self) -> list[ReplicaView]:
        """The replicas as this router last saw them (`routing.RouterViews` reads them)."""
        return list(self._views.values())

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        view = self._views.get(replica_id)
        if view is not None:
            note_routed(view, _keys_of(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._views.pop(replica_id, None)  # a restarted replica holds nothing of its own
        forget_peer(replica_id.unique_id)  # its published objects died with it


def _keys_of(pending: PendingRequest | None) -> RouteKeys:
    route = None if pending is None else pending.kwargs.get("route")
    return route if isinstance(route, RouteKeys) else RouteKeys()


# -- the ingress ----------------------------------------------------------------------------


def _served_modes(model_spec: str | None) -> frozenset[Mode]:
    """The modes the replicas' model serves, known at the ingress without loading it: a
    hybrid's (recurrent layers) is FULL only, read from an HF model directory's config.
    Anything else (a shipped name, a GGUF, a model ragkv does not serve) gets every mode here;
    the replicas load it, and refuse what they cannot serve."""
    from pathlib import Path

    from transformers import AutoConfig

    from ragkv.engine.family import family_of
    from ragkv.errors import UnsupportedModelError

    path = Path(model_spec).expanduser() if model_spec else None
    if path is None or not (path / "config.json").is_file():
        return frozenset(Mode)
    try:
        family = family_of(AutoConfig.from_pretrained(path))
    except UnsupportedModelError:
        return frozenset(Mode)
    return frozenset({Mode.FULL}) if family.recurrent else frozenset(Mode)



class IngressBackend:
    """The ingress's `Catalogue`: the indexes for search, the replicas for the rest (answers go
    through `RoutedRunner`, which searches here and answers on a replica)."""

    def __init__(self, settings: ServerSettings, engines: DeploymentHandle) -> None:
        from ragkv.kvstore import hash_prefix
        from ragkv.retriever import Retriever
        from ragkv.retriever.chunk_keys import NeighbourOptions
        from ragkv.server.search_config import retriever_options

        search = retriever_options(settings)
        self._retrievers = {spec.name: Retriever.open(spec.index_dir, **search) for spec in settings.indexes}
        self._prefix_hash = {n: hash_prefix(r.manifest.prefix_ids) for n, r in self._retrievers.items()}
        self._neighbours = {n: NeighbourOptions.from_dict(r.manifest.neighbours) for n, r in self._retrievers.items()}
        self._focus_handover = settings.focus_handover
        self._engines = engines
        first = next(iter(self._retrievers.values()), None)
        self._modes = _served_modes(settings.served_model(first.manifest.model_spec) if first else settings.model)

    @property
    def modes(self) -> frozenset[Mode]:
        return self._modes

    def _retriever(self, name: str) -> Retriever:
        try:
            return self._retrievers[name]
        except KeyError:
            raise UnknownCollectionError.naming(name, self._retrievers) from None

    def parts(self) -> BackendParts:
        return BackendParts()  # the engines, their trees and tiers are the replicas'

    def collections(self) -> Sequence[CollectionInfo]:
        return [CollectionInfo(n, len(r), r.manifest.model_fp, r.manifest.tokenizer_fp)
                for n, r in self._retrievers.items()]

    def collection_stats(self, name: str) -> CollectionStats:
        self._retriever(name)
        return self._engines.collection_stats.remote(name).result()  # one replica's tiers

    def retrieve(self, collection: str, question: str, top_k: int, search_mode: SearchMode | None = None,
                 filters: Sequence[MetadataFilter] = ()) -> tuple[RetrievedChunk, ...]:
        from ragkv.server.pipeline import retrieved_chunk, search_hits

        return tuple(map(retrieved_chunk, search_hits(self._retriever(collection), question, top_k, search_mode,
                                                      filters)))

    def search(self, query: Query) -> tuple[list[SearchHit], RouteKeys]:
        """The query's chunks and what routing looks for (the keys the replica will read)."""
        from ragkv.retriever.chunk_keys import serving_keys
        from ragkv.server.pipeline import search_hits

        r = self._retriever(query.collection)
        hits = search_hits(r, query.question, query.top_k, query.search_mode, query.filters)
        m = r.manifest
        keys = [k.hex for k in serving_keys(hits, query.mode, self._neighbours[query.collection],
                                            self._prefix_hash[query.collection], m.model_fp, m.tokenizer_fp,
                                            self._focus_handover)]
        return hits, route_keys(query, keys, [len(h.token_ids) for h in hits])


@runtime_checkable
class Searcher(Protocol):
    """What `RoutedRunner` asks of the ingress's backend (`IngressBackend`): a query's chunks, and
    what routing looks for."""

    def search(self, query: Query) -> tuple[list[SearchHit], RouteKeys]: ...


class RoutedRunner:
    """The ingress's `Answerer`: retrieve here, answer on the replica the router picks."""

    def __init__(self, *, engines: DeploymentHandle, admission: Admission, metrics: ServerMetrics,
                 pool: ThreadPoolExecutor, retries: int) -> None:
        self._engines = engines
        self._admission = admission
        self._metrics = metrics
        self._pool = pool
        self._retries = retries
        self.pins = ConversationPins()  # conversation -> the replica that answered it last

    async def run(self, backend: Catalogue, query: Query, *, arrived: float, cancel: threading.Event,
                  deadline: float | None = None, method: str = "Query",
                  reserve: Callable[[int], None] | None = None) -> AsyncIterator[RunEvent]:
        if not isinstance(backend, Searcher):
            raise TypeError(f"RoutedRunner searches with the ingress's backend, not {type(backend).__name__}: a bug")
        loop = asyncio.get_running_loop()
        with self._admission.query_slot():
            searched = time.perf_counter()
            hits, route = await loop.run_in_executor(self._pool, backend.search, query)
            if reserve is not None:  # the key's prompt tokens before a replica computes any: the chunks'
                reserve(sum(len(h.token_ids) for h in hits))  # (the rest is settled with the answer's count)
            route = self.pins.pin(route)  # its conversation's replica, when one answered it before
            retrieve_s = time.perf_counter() - searched
            asked = Asked.of(query, deadline)
            for attempt in range(self._retries + 1):
                held: list[ChunksEvent] = []  # the chunks, until the answer has begun
                begun = False
                replica: str | None = None  # which one answers (its `Answering`)
                first_token_at: float | None = None
                stream = self._engines.options(stream=True).answer.remote(asked, hits, route=route)
                try:
                    async for event in stream:
                        if cancel.is_set():
                            stream.cancel()
                            return
                        if isinstance(event, Answering):
                            replica = event.replica
                            continue
                        if isinstance(event, ChunksEvent) and not begun:
                            held.append(event)
                            continue
                        if not begun:
                            begun = True
                            if replica is not None:  # its tree now holds the conversation
                                self.pins.note(route.conversation, replica)
                            for h in held:
                                self._metrics.observe_chunks(h.chunks, query.collection)
                                yield h
                        if isinstance(event, QueryStats):
                            end = time.perf_counter()
                            event = dataclasses.replace(
                                event, ttft_seconds=(first_token_at or end) - arrived, total_seconds=end - arrived,
                                phase_seconds={**event.phase_seconds, "retrieve": retrieve_s})
                            self._observe(query, event, method)
                        elif first_token_at is None:
                            first_token_at = time.perf_counter()
                        yield event
                    return
                except RayActorError as exc:
                    if begun:
                        raise ReplicaLostError(
                            "the replica answering this request stopped mid-answer (its process died); the "
                            "answer is incomplete: send the request again") from exc
                    log.warning("replica lost before the answer began (attempt %d): %s", attempt + 1, exc)
                    if attempt == self._retries:
                        raise NotServingError(
                            f"{attempt + 1} replicas stopped before answering this request; the cluster is "
                            "restarting them: try again shortly") from exc
                except RayTaskError as exc:  # the replica raised: the error as it raised it
                    cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                    raise cause from None


    def _observe(self, query: Query, stats: QueryStats, method: str) -> None:
        """The answer in the cluster's metrics (the ingress serves them): every replica's answers
        in one place, timed from their arrival here. Bytes per tier stay the replicas' own."""
        self._metrics.observe_answer(stats.mode, stats.ttft_seconds, stats.recompute_fraction, {},
                                     query.collection, stats.kv_sources)
        self._metrics.e2e.labels(method).observe(stats.total_seconds)
        u = stats.usage
        self._metrics.observe_usage(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens, query.collection)
        self._metrics.requests.labels("OK").inc()


class _ServeContext:
    """grpc.aio's ServicerContext, as far as `RagService` uses it, over Ray Serve's gRPC context:
    `abort` sets the status (Ray Serve's proxy sends what the method set) and ends the call."""

    def __init__(self, grpc_context: Any) -> None:
        self._context = grpc_context

    def time_remaining(self) -> float | None:
        return None  # Ray Serve's proxy does not pass the client's deadline on

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._context.set_code(code)
        self._context.set_details(details)
        raise _Aborted(details)


class _Aborted(Exception):
    """Ends a gRPC method after `_ServeContext.abort` set its status."""


class Ingress:
    """The cluster's front: the gRPC methods (`ragkv.v1.RagService`, `grpc.health.v1.Health`),
    the OpenAI HTTP API as its ASGI app, each answer routed to an engine replica."""

    def __init__(self, settings: ServerSettings, engines: DeploymentHandle, retries: int = 2) -> None:
        from ragkv.server.assembly import fetch_indexes

        logging.basicConfig(level=settings.log_level)
        fetch_indexes(settings)  # an s3:// index, synced onto the ingress's host
        self.settings = settings
        self.metrics = ServerMetrics()
        self._admission = Admission(settings.max_queue * 4, self.metrics.queue_depth.set)
        self._pool = ThreadPoolExecutor(max(2, settings.retrieve_workers), thread_name_prefix="ragkv-ingress")
        self.backend = IngressBackend(settings, engines)
        self._runner = RoutedRunner(engines=engines, admission=self._admission, metrics=self.metrics,
                                    pool=self._pool, retries=retries)
        # Ray Serve's gRPC proxy takes no interceptor: RagService checks each call's key itself
        self.keys = settings.key_ring()
        self.service = RagService(limits=settings.limits(), admission=self._admission, metrics=self.metrics,
                                  retrieve_pool=self._pool, runner=self._runner, keys=self.keys)
        self.service.backend = self.backend  # retrieval here, answers on the replicas
        self.metrics.watch_routing(routing.ROUTER_VIEWS.read)  # the router's decisions and the replicas' gauges
        if settings.metrics_port is not None:  # the ingress's own: requests, errors, end-to-end latency
            self.metrics.serve(settings.metrics_port, settings.metrics_host)

    def __serve_build_asgi_app__(self) -> Any:
        from ragkv.server.openai_api import OpenAIApi
        from ragkv.server.responses_api import with_responses

        api = OpenAIApi(runner=self._runner, admission=self._admission, limits=self.settings.limits(),
                        metrics=self.metrics, backend=lambda: self.backend, keys=self.keys,
                        max_body_bytes=self.settings.max_request_bytes)  # checked there, as in one process
        return with_responses(api, self.settings)

    async def _context(self, grpc_context: Any, method: str) -> _ServeContext:
        """The call's context (RagService checks its key from the metadata)."""
        return _ServeContext(grpc_context)

    async def Query(self, request: pb.QueryRequest, grpc_context: Any = None) -> AsyncIterator[pb.QueryResponse]:
        async for message in self.service.Query(request, await self._context(grpc_context, "Query")):
            yield message

    async def Retrieve(self, request: pb.RetrieveRequest, grpc_context: Any = None) -> pb.RetrieveResponse:
        return await self.service.Retrieve(request, await self._context(grpc_context, "Retrieve"))

    async def ListCollections(self, request: pb.ListCollectionsRequest,
                              grpc_context: Any = None) -> pb.ListCollectionsResponse:
        return await self.service.ListCollections(request, await self._context(grpc_context, "ListCollections"))

    async def GetCollectionStats(self, request: pb.GetCollectionStatsRequest,
                                 grpc_context: Any = None) -> pb.GetCollectionStatsResponse:
        return await self.service.GetCollectionStats(request, await self._context(grpc_context, "GetCollectionStats"))

    def Check(self, request: Any, grpc_context: Any = None) -> Any:  # grpc.health.v1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


# -- assembling and running it --------------------------------------------------------------


def build_app(settings: ServerSettings, cluster: ClusterSettings) -> Any:
    """The Ray Serve application: the ingress bound to the engine replicas' deployment."""
    router = RequestRouterConfig(
        request_router_class=ChunkRouter,
        request_router_kwargs={"policy": cluster.routing.value, "slack": cluster.route_slack,
                               "peers": cluster.peer(settings) is not None},
        request_routing_stats_period_s=cluster.stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 5 * cluster.stats_period_s),
    )
    engines = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=cluster.replicas,
        max_ongoing_requests=max(settings.max_queue, 1), request_router_config=router,
        ray_actor_options={"num_cpus": cluster.cpus_per_replica, "num_gpus": cluster.gpus_per_replica},
        health_check_period_s=2.0, health_check_timeout_s=30.0,
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=1,
                               max_ongoing_requests=settings.max_queue * 4,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(settings, engines.bind(settings, cluster.peer(settings)), cluster.retries)


def forget_peer(replica: str) -> None:
    """Tell the peer directory (when one runs) that `replica` is gone."""
    from ragkv.kvstore.tiers.peer_ray import RayDirectory, find_directory

    try:
        actor = find_directory()
    except Exception as e:
        log.debug("no peer directory to tell of %s: %s", replica, e)
        return
    if actor is not None:
        RayDirectory(actor, 1.0).forget(replica)


def start(settings: ServerSettings, cluster: ClusterSettings, *, blocking: bool = False) -> DeploymentHandle:
    """Connect to (or start) Ray, start Serve's proxies on the settings' ports, deploy.

    gRPC on `settings.port`, the OpenAI HTTP API on `settings.http_port` (8000 when unset).
    """
    import ray

    check_ray_auth(cluster.ray_address, settings.insecure_no_auth)  # before joining: a refusal joins nothing
    # Ray Serve's gRPC proxy reads a message whole before RagService checks its key: bound it as one
    # process is (a proxy started by this process's Ray inherits it; remote nodes set it themselves)
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(settings.max_request_bytes))
    # Serve's controller kills a proxy not ready within 5 s and starts another, and serve.start,
    # waiting on the first, then fails; a loaded host starts one slower than that (a local Ray's
    # controller inherits this process's environment)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_S))
    # the HTTP proxy's own /-/routes answers without a key: the proxy wraps itself in what this
    # names, which refuses it (a proxy on a node you start yourself needs it set there)
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", ray_proxy.CALLBACK)
    if not ray.is_initialized():
        _signal_handlers.setdefault(signal.SIGTERM, signal.getsignal(signal.SIGTERM))  # ray.init installs its own
        ray.init(address=cluster.ray_address, include_dashboard=False, log_to_driver=False,
                 **({} if cluster.ray_address else {"num_cpus": max(os.cpu_count() or 1, cluster.replicas + 1)}))
    if cluster.peer(settings) is not None:  # before the replicas, which look it up as they start
        from ragkv.kvstore.tiers.peer_ray import directory_actor

        directory_actor()
    http = {"host": settings.host, "port": settings.http_port or 8000}
    if settings.tls_cert is not None and settings.tls_key is not None:
        http |= {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    # no server reflection: Ray's proxy serves it beside the key check (RagService makes that
    # check itself: the proxy takes no interceptor), so it would describe the API to anyone
    no_reflection = {"enable_reflection": False} if "enable_reflection" in gRPCOptions.model_fields else {}
    grpc = (gRPCOptions(port=settings.port, grpc_servicer_functions=list(_SERVICER_FUNCTIONS), **no_reflection)
            if grpc_served(settings) else None)
    try:  # a proxy on every node: a load balancer may send a request to any of them
        serve.start(proxy_location="EveryNode", http_options=http, grpc_options=grpc)
    except RayActorError as e:  # the controller replaced a proxy slow to start: it runs, wait on it in serve.run
        log.warning("a Serve proxy was restarted while starting (%s); waiting for its replacement",
                    str(e).splitlines()[0])
    return serve.run(build_app(settings, cluster), name=APP_NAME, route_prefix="/", blocking=blocking)


def grpc_served(settings: ServerSettings) -> bool:
    """Whether the cluster serves gRPC. Ray Serve's gRPC proxy speaks no TLS (with --tls-cert only
    HTTPS is served) and listens on every interface whatever --host says, so without credentials
    (--api-keys, --auth-token-file) it is not started, unless --insecure-no-auth: then the cluster
    answers over the HTTP API on --host alone."""
    if settings.tls_cert is not None:
        return False
    if settings.key_ring().enabled or settings.insecure_no_auth:
        return True
    log.warning("gRPC is not served: Ray Serve's gRPC proxy listens on every interface whatever --host says, "
                "and no credentials were given. Give --api-keys or --auth-token-file to serve gRPC (every call then "
                "needs a key), or --insecure-no-auth on a network you trust; the HTTP API listens on %s",
                settings.host)
    return False


def ray_token_auth_on() -> bool:
    """Whether this process's Ray speaks token authentication (Ray >= 2.52, RAY_AUTH_MODE=token)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth
        return False
    return bool(is_token_auth_enabled())


def check_ray_auth(ray_address: str | None, insecure_no_auth: bool = False) -> None:
    """Joining a Ray cluster over the network needs Ray's token authentication on: without it
    anyone who reaches Ray's ports runs code on every node. A local Ray (no address) is exempt.

    Raises:
        ValueError: naming RAY_AUTH_MODE=token and the opt-out.
    """
    if ray_address is None or ray_token_auth_on():
        return
    if insecure_no_auth:
        log.warning("joining Ray at %s WITHOUT Ray token authentication (--insecure-no-auth)", ray_address)
        return
    raise ValueError(f"refusing to join the Ray cluster at {ray_address} without Ray's token authentication: "
                     f"set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) on every node (Ray >= "
                     f"2.52), or pass --insecure-no-auth on a network you trust")


def undeploy() -> None:
    """Take the application down (its replicas stop); Serve and Ray stay up for the next one."""
    serve.delete(APP_NAME)


def stop() -> None:
    """Take the application down and shut Serve and Ray (when this process started it)."""
    import ray

    from ragkv.kvstore.tiers.peer_ray import kill_directory

    serve.shutdown()
    if ray.is_initialized():
        kill_directory()  # detached: it would outlive this process on a cluster it joined
    ray.shutdown()
    # what this process did on SIGTERM before Ray (a bench or a test goes on after); only the
    # main thread may set a handler
    while _signal_handlers and threading.current_thread() is threading.main_thread():
        signal.signal(*_signal_handlers.popitem())


_signal_handlers: dict[signal.Signals, Any] = {}  # signal -> this process's handler before `start`'s ray.init


__all__ = ["Asked", "ChunkRouter", "ClusterSettings", "EngineReplica", "Ingress", "PeerSettings", "build_app",
           "route_keys", "start", "stop"]
