"""The QueryBackend protocol: what the gRPC layer needs from retrieval and generation.

The gRPC layer (validation, status codes, auth, health, metrics, queue, cancellation,
drain) knows only this protocol; `server.pipeline.Pipeline` implements it over
retriever + kvstore + engine, and tests implement it with a fake. Nothing here
imports torch, FAISS or gRPC.

Threading contract: `collections`, `collection_stats`, `retrieve` and `prepare` may
run on any worker thread, concurrently with `answer`; `answer` runs on the single
scheduler thread (engine.scheduler), which interleaves the answers of many requests:
an answer yields `int` steps of prompt work and `engine.scheduler.Decode` to have its
decode batched with the others.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ragkv.types import (
    ChatTurn,
    CollectionInfo,
    CollectionStats,
    FinishReason,
    KVSource,
    MetadataFilter,
    Mode,
    ResponseFormat,
    RetrievedChunk,
    SearchMode,
    Tier,
    Tool,
    ToolChoice,
)


@dataclass(frozen=True, slots=True)
class SearchParams:
    """How a request searches its collection."""

    mode: SearchMode | None = None  # dense, lexical or hybrid; None = the collection's default
    filters: tuple[MetadataFilter, ...] = ()  # metadata conditions, all must hold, applied before top_k


@dataclass(frozen=True, slots=True)
class QueryParams:
    """A validated Query with every default resolved."""

    question: str  # non-empty, within the length limit
    collection: str  # a collection this server serves
    top_k: int  # chunks to retrieve, >= 1
    mode: Mode  # how the prompt KV is assembled
    recompute_ratio: float  # [0, 1], used by BLEND
    temperature: float  # >= 0; 0 = greedy
    top_p: float  # (0, 1]
    seed: int | None  # sampling seed
    max_new_tokens: int  # >= 1
    stop: tuple[str, ...]  # stop strings
    search: SearchParams = SearchParams()  # search mode and metadata filters
    history: tuple[ChatTurn, ...] = ()  # earlier turns, oldest first: after the chunks, before the question
    system_prompt: str | None = None  # the client's system message; must equal the index's (None = not given)
    agent_turns: tuple[ChatTurn, ...] = ()  # since the question: the assistant's tool calls and their results
    response_format: ResponseFormat = ResponseFormat()  # the answer's shape (constrained decoding)
    tools: tuple[Tool, ...] = ()  # functions the model may call
    tool_choice: ToolChoice = ToolChoice()  # whether it must call them
    parallel_tool_calls: bool = True  # several calls in one answer allowed
    citations: bool = False  # mark sources as [n], naming only retrieved chunks


@dataclass(frozen=True, slots=True)
class PreparedQuery:
    """A Query after retrieval, with its KV loads already started."""

    params: QueryParams  # the request
    chunks: tuple[RetrievedChunk, ...]  # retrieved, best first (kv_tier not known yet)
    phase_seconds: Mapping[str, float]  # phases done so far (retrieve, ...)
    state: object = None  # backend-private (prefetch handles, hits)
    kv_bytes: int = 0  # KV cache bytes the answer holds at most (admission by memory)
    prompt_cost: int = 0  # about how much work its prompt pass is (Engine.prompt_cost): cheapest runs first
    reads_tool_calls: bool = False  # the answer may be tool calls (server.structured.ToolCallReader reads them)


@dataclass(frozen=True, slots=True)
class ChunksEvent:
    """First event of an answer: the chunks with the tier their KV came from."""

    chunks: tuple[RetrievedChunk, ...]  # best first, kv_tier set


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One decoded text piece."""

    text: str  # non-empty piece of the answer


class AnswerText(Protocol):
    """An answer's detokenizer (`engine.detokenize.Detokenizer`): token ids in, final text out,
    stop strings applied (finding one tells the decode to stop)."""

    stopped: bool  # a stop string ended the text

    @property
    def token_count(self) -> int: ...  # the answer's tokens (none past a stop string)

    def push(self, token: int) -> str: ...  # the text that became final

    def finish(self) -> str: ...  # the rest, at the end


@dataclass(frozen=True, slots=True)
class TokenIdEvent:
    """One generated token, not yet text: the consumer detokenizes it (off the scheduler thread)."""

    token_id: int
    text: AnswerText  # the answer's detokenizer, the same for all its tokens


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """Last event of an answer."""

    prompt_tokens: int  # prefix + chunks + question
    cached_prompt_tokens: int  # prompt tokens whose KV came from a cache tier
    completion_tokens: int  # pieces generated
    recompute_fraction: float  # fraction of chunk tokens recomputed, [0, 1]
    finish_reason: FinishReason  # why decoding stopped
    phase_seconds: Mapping[str, float]  # seconds per backend phase (kv_load, blend..., decode)
    bytes_loaded: Mapping[Tier, int] = field(default_factory=dict)  # KV bytes read per tier
    used_chunk_ids: tuple[str, ...] = ()  # chunks the answer was computed over, prompt order; () = all
    kv_sources: Mapping[KVSource, int] = field(default_factory=dict)  # chunks by where their KV came from
    fell_back: bool = False  # the quality guard ran the prompt as full prefill
    handed_over: bool = False  # focus found several passages mattering and blended every chunk
    tree_prompt_tokens: int = 0  # prompt tokens whose KV came from the KV tree (in cached_prompt_tokens too)


AnswerEvent = ChunksEvent | TokenEvent | TokenIdEvent | DoneEvent


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

    def retrieve(self, collection: str, question: str, top_k: int,
                 search: SearchParams | None = None) -> tuple[RetrievedChunk, ...]:
        """Search a collection; no model work. ``search`` None: the server's search defaults.

        Raises:
            UnknownCollectionError: No collection of that name.
        """
        ...

    def prepare(self, params: QueryParams) -> PreparedQuery:
        """Retrieve and start loading the chunks' KV at once (non-blocking loads).

        Raises:
            UnknownCollectionError: No collection of that name.
            IndexMismatchError: The index was built with another model.
        """
        ...

    def answer(self, prepared: PreparedQuery, cancel: threading.Event) -> Iterator[AnswerEvent]:
        """Blend and decode: yields one ChunksEvent, TokenEvents (or TokenIdEvents), then one DoneEvent.

        Runs on the engine thread. Stops early (without DoneEvent) once `cancel` is set.
        """
        ...
