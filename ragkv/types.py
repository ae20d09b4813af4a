"""Domain types of the ragkv API, shared by the client SDK and the server.

Plain frozen dataclasses and enums: no protobuf, no gRPC, no torch. `ragkv.convert`
is the one place that turns them into wire messages and back.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_COLLECTION = "default"


class Mode(enum.Enum):
    """How the prompt KV is assembled before decoding."""

    FULL = "full"  # plain prefill of the whole prompt (the baseline)
    PREFIX = "prefix"  # reuse only the shared prefix KV
    REUSE = "reuse"  # concatenate cached chunk KVs, recompute only the question
    BLEND = "blend"  # selective recompute (CacheBlend)
    CLIP = "clip"  # tokens picked by an auxiliary model's attention (CacheClip)
    FOCUS = "focus"  # only the chunks the question attends to (engine.focus)


class Tier(enum.Enum):
    """Where a chunk's KV came from for one request."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    S3 = "s3"
    COMPUTED = "computed"  # missing from every tier: computed on the spot, written back
    NOT_LOADED = "not_loaded"  # the mode does not use cached chunk KV


class FinishReason(enum.Enum):
    """Why decoding stopped."""

    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # end-of-sequence token or a stop string


@dataclass(frozen=True, slots=True)
class QueryOptions:
    """What a client asks for besides the question; None means the server's default."""

    collection: str | None = None  # collection name; None = "default"
    top_k: int | None = None  # chunks to retrieve
    mode: Mode | None = None  # None = server default (FOCUS unless configured otherwise)
    recompute_ratio: float | None = None  # fraction of context tokens recomputed, [0, 1]
    temperature: float = 0.0  # 0 = greedy
    top_p: float | None = None  # nucleus mass in (0, 1]
    seed: int | None = None  # sampling RNG seed
    max_new_tokens: int | None = None  # answer length cap, tokens
    stop: tuple[str, ...] = ()  # stop strings
    snippet_chars: int | None = None  # chunk text characters to return; None = all


@dataclass(frozen=True, slots=True)
class RetrievedChunk:
    """One retrieved chunk as the client sees it."""

    chunk_id: str  # stable id of the chunk in its index
    score: float  # retriever similarity, higher is closer
    text: str  # chunk text, or a snippet of it
    metadata: Mapping[str, str] = field(default_factory=dict)  # source, title, offsets...
    kv_tier: Tier | None = None  # where the KV came from; None in Retrieve
    num_tokens: int = 0  # tokens of the chunk in the prompt


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answered query."""

    prompt_tokens: int  # prefix + chunks + question
    completion_tokens: int  # text pieces generated
    cached_prompt_tokens: int  # prompt tokens whose KV came from a cache tier


@dataclass(frozen=True, slots=True)
class QueryStats:
    """The final message of a Query stream."""

    usage: Usage  # token counts
    ttft_seconds: float  # server-side, request arrival to first token
    total_seconds: float  # server-side, request arrival to last token
    phase_seconds: Mapping[str, float]  # seconds per phase (queue, retrieve, kv_load, ...)
    recompute_fraction: float  # fraction of chunk tokens recomputed, [0, 1]
    mode: Mode  # the mode actually used
    finish_reason: FinishReason  # why decoding stopped
    text: str  # the whole answer
    used_chunk_ids: tuple[str, ...] = ()  # chunks the answer was computed over (FOCUS keeps a subset)


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    """The answer of Retrieve."""

    chunks: tuple[RetrievedChunk, ...]  # best first
    retrieve_seconds: float  # server-side search time


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    """One collection (one index directory) served by a server."""

    name: str  # collection name
    num_chunks: int  # chunks in the index
    model_fingerprint: str  # model the index's KVs were computed with
    tokenizer_fingerprint: str  # tokenizer the chunks were tokenized with


@dataclass(frozen=True, slots=True)
class TierStats:
    """KV-store counters of one tier."""

    tier: Tier  # which tier
    entries: int  # KV entries held
    bytes: int  # bytes held
    hits: int  # lookups answered by this tier
    misses: int  # lookups this tier could not answer
    bytes_loaded: int  # bytes read from this tier since start


@dataclass(frozen=True, slots=True)
class CollectionStats:
    """A collection with its KV-store statistics."""

    collection: CollectionInfo  # the collection
    tiers: tuple[TierStats, ...]  # one per configured tier, top first
