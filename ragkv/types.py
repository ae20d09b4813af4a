"""Domain types of the ragkv API, shared by the client SDK and the server.

Plain frozen dataclasses and enums: no protobuf, no gRPC, no torch. `ragkv.convert`
is the one place that turns them into wire messages and back.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

DEFAULT_COLLECTION = "default"


class Mode(str, enum.Enum):
    """How the prompt KV is assembled before decoding: the one mode enum, wire to engine.

    What each mode recomputes and counts as cached is the engine's to say (ragkv.engine.blend).
    """

    FULL = "full"  # plain prefill of the whole prompt (the baseline)
    PREFIX = "prefix"  # reuse only the shared prefix KV
    REUSE = "reuse"  # concatenate cached chunk KVs, recompute only the question
    BLEND = "blend"  # selective recompute (CacheBlend)
    FOCUS = "focus"  # only the chunks the question attends to (engine.focus)


class DType(str, enum.Enum):
    """What a model's weights and KV compute in: the one dtype spelling, from the command
    line and settings to the engine (`ragkv.engine.model_loading.resolve_dtype` maps it to torch)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO = "auto"  # bfloat16 on CUDA, float32 elsewhere (CPUs are slow at 16-bit)

    @classmethod
    def concrete(cls) -> tuple[DType, ...]:
        """The dtypes a model runs in (all but AUTO)."""
        return (cls.FLOAT32, cls.BFLOAT16, cls.FLOAT16)


class SearchMode(str, enum.Enum):
    """Which index a request searches: the one search-mode enum, wire to retriever."""

    DENSE = "dense"  # embedding similarity (FAISS)
    LEXICAL = "lexical"  # BM25 over chunk text: exact names, codes, identifiers
    HYBRID = "hybrid"  # both, fused (reciprocal rank fusion by default)


class FilterOp(str, enum.Enum):
    """How a metadata filter compares a document's value with its own."""

    EQUALS = "equals"  # same JSON type and value (1 != "1", True != 1)
    PREFIX = "prefix"  # the document's value is a str starting with the filter's str


@dataclass(frozen=True, slots=True)
class MetadataFilter:
    """One condition on a chunk's document metadata; a request's filters must all hold."""

    key: str  # metadata key ("source", or a JSONL document's own field)
    value: Any  # a JSON value (str, int, float, bool, None, list, dict); a str for PREFIX
    op: FilterOp = FilterOp.EQUALS  # how to compare

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"metadata filter key must be a non-empty str, got {self.key!r}")
        if not isinstance(self.op, FilterOp):
            object.__setattr__(self, "op", FilterOp(self.op))
        if self.op is FilterOp.PREFIX and not isinstance(self.value, str):
            raise ValueError(
                f"prefix filter on {self.key!r} needs a str value, got {type(self.value).__name__} {self.value!r}"
            )

    def matches(self, metadata: Mapping[str, Any]) -> bool:
        """Whether ``metadata`` satisfies this condition (a missing key never does)."""
        if self.key not in metadata:
            return False
        have = metadata[self.key]
        if self.op is FilterOp.PREFIX:
            return isinstance(have, str) and have.startswith(self.value)
        # JSON equality: bool is not int, int 1 equals float 1.0 as in JSON
        if isinstance(have, bool) or isinstance(self.value, bool):
            return type(have) is type(self.value) and have == self.value
        return have == self.value


class Tier(str, enum.Enum):
    """Where a chunk's KV lives (the storage tiers, fastest first) or came from for one request.

    The one tier enum, from kvstore's tiers to the wire. The first five hold KV: four a store
    is configured with, and PEER, which a cluster's replicas attach to their stores
    (`kvstore.tiers.peer`). Where each sits in the lookup order, whether it outlives the
    process and how it is built are its kind's, in kvstore (`kvstore.tiers.kinds`).
    """

    GPU = "gpu"  # device memory (CUDA only)
    CPU = "cpu"  # host memory, pinned when CUDA is there
    DISK = "disk"  # files on a local SSD
    S3 = "s3"  # objects in an S3-compatible bucket
    # another replica's host tier, read through Ray's object store (`ragkv serve --replicas`);
    # looked at after the local tiers, before S3
    PEER = "peer"
    COMPUTED = "computed"  # missing from every tier: computed on the spot, written back
    NOT_LOADED = "not_loaded"  # the mode does not use cached chunk KV
    TREE = "tree"  # the server's KV tree held it, in an earlier call's context (engine.kv.tree)


class KVSource(str, enum.Enum):
    """Where one request's chunk KV came from, and why: the loading controller's decision
    (server/loading_controller.py), counted per request in `QueryStats.kv_sources` and in a metric."""

    LOADED = "loaded"  # read from a tier: the cheaper way
    COMPUTED_MISSING = "computed_missing"  # in no tier: computed (and written back)
    COMPUTED_CHEAPER = "computed_cheaper"  # its tier is slower than recomputing it: computed, not read
    COMPUTED_OVERRUN = "computed_overrun"  # its read overran the estimate: abandoned and computed
    COMPUTED_FAILED = "computed_failed"  # its read failed (damaged or unreachable): computed

Fingerprint = NewType("Fingerprint", str)  # sha256 hex naming a model, tokenizer or embedder


class FinishReason(enum.Enum):
    """Why decoding stopped."""

    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # end-of-sequence token, a stop string, or the end of the answer's grammar
    TOOL_CALLS = "tool_calls"  # the answer is one or more tool calls


# a tenant (whose KV-tree paths a request reads) is its API key's name, or that name, SALT_SEP and the
# request's cache_salt: salts keep conversations apart within a key; shares count per key (TreeKey.owner)
SALT_SEP = "\x1f"


class LengthLimit(str, enum.Enum):
    """What bounded an answer's length (what a LENGTH finish ran into)."""

    MAX_TOKENS = "max_tokens"  # the client's max_tokens / max_completion_tokens / max_output_tokens
    SERVER_DEFAULT = "server_default"  # the server's --default-max-new-tokens (the client set none)
    SERVER_CAP = "server_cap"  # the server's --max-new-tokens, the longest answer (the client set none)
    CONTEXT = "context"  # the model's context ran out (the client set none)


class SystemPromptPath(str, enum.Enum):
    """How a request's system message was served."""

    INDEXED = "indexed"  # the index's own (none given, or the same): the chunks' KV follows it as stored
    PREFIX = "prefix"  # its own, computed in front of the chunks; their KV moved after it and blended
    SUFFIX = "suffix"  # its own, placed after the chunks (the index's prefix before them)


class ChatRole(str, enum.Enum):
    """Who said a turn of a conversation."""

    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result, answering one of the assistant's tool calls


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool, as the model made it (OpenAI's `tool_calls` item)."""

    id: str  # names the call; the tool's result turn carries it back
    name: str  # the tool's name
    arguments: str  # the arguments, a JSON object as text (valid against the tool's schema)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed tool call, as OpenAI streams them: the first piece of a call
    carries its id and name, the later ones pieces of its arguments."""

    index: int  # which call of the answer, from 0
    id: str | None  # on the call's first piece
    name: str | None  # on the call's first piece
    arguments: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One turn of a conversation besides the question; it goes after the chunks."""

    role: ChatRole  # user, assistant, or tool
    content: str  # what was said (a tool's result, for TOOL)
    tool_calls: tuple[ToolCall, ...] = ()  # ASSISTANT: the calls it made
    tool_call_id: str | None = None  # TOOL: the call this result answers

    def __post_init__(self) -> None:
        if not isinstance(self.role, ChatRole):
            try:
                object.__setattr__(self, "role", ChatRole(self.role))
            except ValueError:
                raise ValueError(f"chat turn role must be user, assistant or tool, got {self.role!r}") from None


class ResponseFormatKind(str, enum.Enum):
    """What the answer must be (OpenAI's `response_format.type`)."""

    TEXT = "text"  # free text
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON valid against a schema


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """The answer's required shape, enforced by constrained decoding."""

    kind: ResponseFormatKind = ResponseFormatKind.TEXT
    schema: Mapping[str, Any] | None = None  # JSON_SCHEMA: the JSON schema
    name: str = ""  # JSON_SCHEMA: the schema's name
    strict: bool = False  # JSON_SCHEMA: no properties beyond the schema's (always enforced for required ones)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (OpenAI's `tools` item of type function)."""

    name: str  # [A-Za-z0-9_-]{1,64}
    description: str = ""  # what it does, for the model
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})  # JSON schema


class ToolChoiceMode(str, enum.Enum):
    """Whether the model must, may, or must not call tools (OpenAI's `tool_choice`)."""

    AUTO = "auto"  # answer in text or call tools, the model decides
    NONE = "none"  # answer in text
    REQUIRED = "required"  # call one or more tools
    FUNCTION = "function"  # call the one tool named by `ToolChoice.name`


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`tool_choice`: a mode, and the tool's name for FUNCTION."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # FUNCTION: the tool to call


@dataclass(frozen=True, slots=True)
class Citation:
    """One `[n]` marker of a cited answer (`QueryOptions.citations`)."""

    number: int  # n: the chunk's 1-based place among the retrieved chunks
    chunk_id: str  # the chunk it names (always one retrieved for this answer)
    start: int  # the marker's span in the answer text, [start, end)
    end: int
    sentence_start: int  # where the text it marks begins (the sentence, or the previous marker's end)


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
    search_mode: SearchMode | None = None  # None = server default (hybrid)
    filters: tuple[MetadataFilter, ...] = ()  # metadata conditions, all must hold, applied before top_k
    history: tuple[ChatTurn, ...] = ()  # earlier turns, oldest first (after the chunks, before the question)
    system_prompt: str | None = None  # the agent's own instructions; None = the index's (set at index time)
    agent_turns: tuple[ChatTurn, ...] = ()  # since the question: the assistant's tool calls and their results
    response_format: ResponseFormat = ResponseFormat()  # the answer's shape (constrained decoding)
    tools: tuple[Tool, ...] = ()  # functions the model may call
    tool_choice: ToolChoice = ToolChoice()  # whether it must call them
    parallel_tool_calls: bool = True  # several calls in one answer allowed
    citations: bool = False  # mark sources as [n]; only retrieved chunks can be named
    cache_salt: str | None = None  # KV-tree paths shared only with the same key's requests giving this salt
    # seconds an answer that may end in tool calls keeps its KV-tree path pinned; None = the server's learned
    retain_seconds: float | None = None
    # how much this conversation's KV-tree path matters against the key's others (-100..100,
    # higher kept longer; above 0 within the key's share of the tree); None = 0
    retain_priority: int | None = None
    # instead of recompute_ratio: the largest next-token KL from full prefill the answer may have, as the
    # collection's calibration predicts it (the cheapest ratio that meets it; full prefill when none does)
    fidelity_kl: float | None = None


@dataclass(frozen=True, slots=True)
class RetrievedChunk:
    """One retrieved chunk as the client sees it."""

    chunk_id: str  # stable id of the chunk in its index
    score: float  # retriever similarity, higher is closer
    text: str  # chunk text, or a snippet of it
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the document's metadata, JSON types kept
    kv_tier: Tier | None = None  # where the KV came from; None in Retrieve
    num_tokens: int = 0  # tokens of the chunk in the prompt
    found_by: tuple[SearchMode, ...] = ()  # which searches ranked it in their top results (DENSE, LEXICAL)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answered query."""

    prompt_tokens: int  # prefix + chunks + question
    completion_tokens: int  # text pieces generated
    cached_prompt_tokens: int  # prompt tokens whose KV came from a cache (a tier or the KV tree)
    tree_prompt_tokens: int = 0  # of those, the ones the KV tree held: an earlier call's prompt and answer


@dataclass(frozen=True, slots=True)
class FocusSignal:
    """What focus's scoring pass read of one request: whether it answered as a lookup and how
    sure the rule was (docs/quality.md); gRPC `QueryStats.focus`, `ragkv.focus` over HTTP."""

    handed_over: bool  # several passages mattered: blend over every chunk; False = a lookup over the kept ones
    kept_attention: float  # share of the question's attention onto the chunks that the chunks answered over hold, [0, 1]
    spread: float  # the two runners-up's mean score over the best, [0, 1]: high = several passages matter


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
    kv_sources: Mapping[KVSource, int] = field(default_factory=dict)  # chunks by where their KV came from
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer makes (finish_reason TOOL_CALLS); text is then ""
    citations: tuple[Citation, ...] = ()  # the answer's [n] markers, when citations were asked for
    focus: FocusSignal | None = None  # FOCUS: how its rule decided (None in other modes)
    system_prompt: SystemPromptPath = SystemPromptPath.INDEXED  # how its system message was served
    length_limit: LengthLimit | None = None  # finish_reason LENGTH: which limit ended it; None otherwise
    recompute_ratio: float | None = None  # the ratio blend ran at (BLEND, FOCUS's blends); None in other modes
    # the next-token KL from full prefill the collection's calibration predicts for it (0.0 for FULL);
    # None without a calibration, or on a path it did not measure (the request's own system prompt)
    predicted_kl: float | None = None


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
    """A snapshot of one KV-store tier's counters since it was opened: the one type, from
    kvstore's tiers (`StorageTier.stats`) to GetCollectionStats on the wire."""

    tier: Tier  # which tier
    hits: int = 0  # gets that returned an entry
    misses: int = 0  # gets that found nothing usable (rejected ones included)
    rejected: int = 0  # stored copies refused on read: corrupt, truncated, another model's or key's
    errors: int = 0  # I/O failures (e.g. S3 endpoint down), each also a miss or a raised StoreError
    puts: int = 0  # entries stored
    refused: int = 0  # puts not stored because one entry exceeds the whole byte budget
    evictions: int = 0  # entries dropped to stay under the byte budget
    bytes_read: int = 0  # bytes moved out of the tier by hits (file bytes for disk/S3)
    bytes_written: int = 0  # bytes moved into the tier by puts
    entries: int = 0  # entries held now, as far as this process knows
    bytes_used: int = 0  # bytes held now, as far as this process knows
    budget_bytes: int | None = None  # byte budget; None is unbounded
    get_seconds: float = 0.0  # total wall time spent in get, hits and misses
    put_seconds: float = 0.0  # total wall time spent in put
    max_get_seconds: float = 0.0  # slowest single get

    @property
    def mean_get_seconds(self) -> float:
        """Mean wall time of a get (0 before the first)."""
        n = self.hits + self.misses
        return self.get_seconds / n if n else 0.0


@dataclass(frozen=True, slots=True)
class CollectionStats:
    """A collection with its KV-store statistics."""

    collection: CollectionInfo  # the collection
    tiers: tuple[TierStats, ...]  # one per configured tier, top first
