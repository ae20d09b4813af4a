"""Query: what a client asked, validated, every default resolved.

One frozen, serializable value from validation on: the gRPC service and the HTTP API build
it (`server.validation.validate_query`), the cluster's ingress routes it and sends it to a
replica as it is, and the backend's preparation (`QueryBackend.prepare`) builds the engine's
`engine.request.Request` from it once. Chat turns, tools, retrieval and tenancy end here:
the engine's request holds only what the engine reads (token ids, chunk KV sources,
sampling, constraint, tree lease, status and timings).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.engine.decode import SamplingParams
from ragkv.server.routing import ConversationId, conversation_id
from ragkv.types import (
    DEFAULT_COLLECTION,
    ChatRole,
    ChatTurn,
    LengthLimit,
    MetadataFilter,
    Mode,
    ResponseFormat,
    SearchMode,
    Tool,
    ToolChoice,
)


@dataclass(frozen=True, slots=True)
class Query:
    """One validated query (see the module docstring)."""

    question: str
    collection: str = DEFAULT_COLLECTION
    top_k: int = 4  # chunks to retrieve
    mode: Mode = Mode.FULL
    recompute_ratio: float = 0.2  # BLEND's (and FOCUS's blends') share of chunk tokens recomputed
    recompute_ratio_set: bool = False  # the client chose it (else the server's default did)
    # instead of a ratio: the largest next-token KL from full prefill the collection's calibration may
    # predict (`fidelity_kl`); the cheapest calibrated ratio meeting it serves (`Pipeline.prepare`)
    fidelity_kl: float | None = None
    sampling: SamplingParams = SamplingParams()  # temperature, top_p, seed, max_new_tokens, stop
    # where sampling.max_new_tokens came from: the client's max_tokens, or the server's default or
    # cap (then the context left bounds it too, once the prompt is known: `Pipeline.prepare`)
    length_limit: LengthLimit = LengthLimit.MAX_TOKENS
    search_mode: SearchMode | None = None  # None = the collection's default
    filters: tuple[MetadataFilter, ...] = ()  # metadata conditions, all must hold
    history: tuple[ChatTurn, ...] = ()  # earlier turns, oldest first: after the chunks, before the question
    # the client's system message (None = not given: the index's); another than the index's is served
    # by --system-prompt-policy (`SystemPromptPath`)
    system_prompt: str | None = None
    agent_turns: tuple[ChatTurn, ...] = ()  # since the question: the assistant's tool calls and their results
    response_format: ResponseFormat = ResponseFormat()  # the answer's shape (constrained decoding)
    tools: tuple[Tool, ...] = ()  # functions the model may call
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    citations: bool = False  # mark sources as [n], naming only retrieved chunks
    # whose conversations its KV-tree path belongs to (the API key's name, and its `cache_salt`, of
    # the HTTP body or the gRPC request): a tree path is read only by queries of the same tenant;
    # chunk KV from the index is everyone's
    tenant: str = ""
    # an answer that may end in tool calls keeps its KV-tree path ahead of LRU eviction this many
    # seconds (`retain_seconds`: ragkv's HTTP extra, a gRPC field; at most --kv-tree-retain-max-s);
    # None = the tool latency the server has learned
    retain_seconds: float | None = None
    # how much its conversation's KV-tree path matters against the tenant's others (`retain_priority`,
    # -100..100; engine.kv.retention): lower leaves a tier first
    retain_priority: int = 0

    @property
    def conversation(self) -> ConversationId:
        """The agent conversation it belongs to: what every one of its calls repeats (the
        collection, the system message and the first user message), within its tenant."""
        first = next((t.content for t in self.history if t.role is ChatRole.USER), self.question)
        return conversation_id(self.collection, first, self.system_prompt, self.tenant)
