"""The backend protocols: what the gRPC layer needs from retrieval (`Catalogue`) and
generation (`QueryBackend`).

The gRPC layer (validation, status codes, auth, health, metrics, queue, cancellation,
drain) knows only this protocol; `server.pipeline.Pipeline` implements it over
retriever + kvstore + engine, and tests implement it with a fake. Nothing here
imports FAISS or gRPC.

Threading contract: `collections`, `collection_stats`, `retrieve` and `prepare` may
run on any worker thread; the request's `work` runs on the single scheduler thread
(engine.scheduler), which interleaves the work of many requests; `detokenizer` and
`keep` are called by the answer relay on the event loop (`server/answering.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ragkv.engine.request import ChunkComputed, Request, Work
from ragkv.server.fidelity import RequestRatio, ServedRatio
from ragkv.types import (
    CollectionInfo,
    CollectionStats,
    LengthLimit,
    MetadataFilter,
    Mode,
    RetrievedChunk,
    SearchMode,
    SystemPromptPath,
    Tier,
)

if TYPE_CHECKING:
    from ragkv.engine.decode_graphs import PooledDecoder
    from ragkv.engine.kv.tree import KVTree
    from ragkv.engine.speed import EngineSpeed
    from ragkv.retriever import SearchHit
    from ragkv.server.query import Query


@dataclass(frozen=True, slots=True)
class BackendParts:
    """What a backend gives the server besides answers, once loaded (none of it for a fake or
    a cluster's ingress, whose engines live on the replicas)."""

    kv_tree: KVTree | None = None  # its KV tree: counted in --kv-budget-bytes, exported as metrics
    speed: EngineSpeed | None = None  # the engine's measured rates, which the scheduler learns into
    # I/O failures per (collection, tier) so far, exported as metrics
    tier_errors: Callable[[], Mapping[tuple[str, Tier], int]] | None = None
    # per collection, the ratio its requests that set none get and the KL predicted for it (server/fidelity.py)
    served: Mapping[str, ServedRatio] = field(default_factory=dict)
    decoder: PooledDecoder | None = None  # the engine's pooled decoder (one KV pool, CUDA graphs); None = ragged


class AnswerText(Protocol):
    """An answer's detokenizer (`engine.detokenize.Detokenizer`): token ids in, final text out,
    stop strings applied (finding one tells the request to stop: `Request.stop_after`)."""

    stopped: bool  # a stop string ended the text

    @property
    def token_count(self) -> int: ...  # the answer's tokens (none past a stop string)

    def push(self, token: int) -> str: ...  # the text that became final

    def finish(self) -> str: ...  # the rest, at the end


@dataclass(frozen=True, slots=True)
class Prepared:
    """A query prepared (`QueryBackend.prepare`): the engine's request, and the chunks it was
    retrieved with, the provenance the answer reports (the engine's `ChunksReady` names each
    one's KV tier; the engine never sees them)."""

    request: Request
    chunks: tuple[RetrievedChunk, ...]  # best first, as Request.chunks begins
    system_prompt: SystemPromptPath = SystemPromptPath.INDEXED  # how the request's system message is served
    length_limit: LengthLimit = LengthLimit.MAX_TOKENS  # what bounds its answer's length (QueryStats.length_limit)
    # the ratio its blend runs at and the KL predicted for it (QueryStats.recompute_ratio, predicted_kl)
    ratio: RequestRatio = RequestRatio(None, None)


@runtime_checkable
class Catalogue(Protocol):
    """The read-only side of a backend: its collections, their stats, search. What the gRPC
    service and the HTTP API ask themselves; answers go through their `Answerer`. A cluster's
    ingress is one (`server.cluster.IngressBackend`: the indexes here, the engines on the
    replicas); `QueryBackend` is one that answers too."""

    @property
    def modes(self) -> frozenset[Mode]:
        """The modes this backend can serve."""
        ...

    def collections(self) -> Sequence[CollectionInfo]:
        """Every served collection."""
        ...

    def parts(self) -> BackendParts:
        """What it gives the server besides answers: its KV tree, speed and tier errors."""
        ...

    def collection_stats(self, name: str) -> CollectionStats:
        """One collection with KV-tier counters.

        Raises:
            UnknownCollectionError: No collection of that name.
        """
        ...

    def retrieve(self, collection: str, question: str, top_k: int, search_mode: SearchMode | None = None,
                 filters: Sequence[MetadataFilter] = ()) -> tuple[RetrievedChunk, ...]:
        """Search a collection; no model work. ``search_mode`` None: the server's default.

        Raises:
            UnknownCollectionError: No collection of that name.
        """
        ...


@runtime_checkable
class QueryBackend(Catalogue, Protocol):
    """Retrieval and generation behind the RagService: a `Catalogue` that prepares and answers
    queries on this host (`server.pipeline.Pipeline`; a fake in tests)."""

    def prepare(self, query: Query, hits: Sequence[SearchHit] | None = None) -> Prepared:
        """Retrieve, and build the engine's request for `query` once: its tokens, its chunks with
        their KV reads started (non-blocking), its budgets. Then it can be submitted with its
        `work`. `hits`: the chunks a cluster's ingress retrieved for it (None: search here).

        Raises:
            UnknownCollectionError: No collection of that name.
            IndexMismatchError: The index was built with another model.
            InvalidArgumentError: The request cannot be served as asked (names the field).
        """
        ...

    def work(self, request: Request) -> Work:
        """A prepared request's work (`Engine.work`): the scheduler runs it step by step."""
        ...

    def detokenizer(self, request: Request) -> AnswerText:
        """The answer's text from its token ids; a stop string stops the request."""
        ...

    def keep(self, collection: str, request: Request, computed: ChunkComputed) -> None:
        """A chunk KV the answer computed: store it for the next request (non-blocking)."""
        ...
