"""The QueryBackend protocol: what the gRPC layer needs from retrieval and generation.

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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ragkv.engine.request import ChunkComputed, Request, Work
from ragkv.types import CollectionInfo, CollectionStats, MetadataFilter, Mode, RetrievedChunk, SearchMode

if TYPE_CHECKING:
    from ragkv.retriever import Hit
    from ragkv.server.query import Query


class AnswerText(Protocol):
    """An answer's detokenizer (`engine.detokenize.Detokenizer`): token ids in, final text out,
    stop strings applied (finding one tells the request to stop: `Request.stop_after`)."""

    stopped: bool  # a stop string ended the text

    @property
    def token_count(self) -> int: ...  # the answer's tokens (none past a stop string)

    def push(self, token: int) -> str: ...  # the text that became final

    def finish(self) -> str: ...  # the rest, at the end


@runtime_checkable
class QueryBackend(Protocol):
    """Retrieval and generation behind the RagService."""

    @property
    def modes(self) -> frozenset[Mode]:
        """The modes this backend can serve."""
        ...

    def collections(self) -> Sequence[CollectionInfo]:
        """Every served collection."""
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

    def prepare(self, query: Query, hits: Sequence[Hit] | None = None) -> Request:
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
