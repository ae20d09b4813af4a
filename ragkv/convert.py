"""The one module that converts between ragkv.v1 protobuf messages and ragkv.types.

Both the client SDK and the server use it, so a field added to the .proto is
handled here once (tests/client/test_convert.py checks every field round-trips).
Wire values the domain cannot represent (an enum number this build does not know)
raise `WireValueError` naming the field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ragkv.types import (
    ChatRole,
    ChatTurn,
    Citation,
    CollectionInfo,
    CollectionStats,
    FilterOp,
    FinishReason,
    FocusSignal,
    KVSource,
    LengthLimit,
    MetadataFilter,
    Mode,
    QueryOptions,
    QueryStats,
    ResponseFormat,
    ResponseFormatKind,
    RetrievedChunk,
    RetrieveResult,
    SearchMode,
    SystemPromptPath,
    Tier,
    TierStats,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from ragkv.v1 import ragkv_pb2 as pb

_E = TypeVar("_E", bound=enum.Enum)
_D = TypeVar("_D")


class WireValueError(ValueError):
    """A message field holds a value this build cannot represent.

    Attributes:
        field: Name of the offending request field, as in the .proto.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


_MODE_TO_PB = {
    Mode.FULL: pb.MODE_FULL,
    Mode.PREFIX: pb.MODE_PREFIX,
    Mode.REUSE: pb.MODE_REUSE,
    Mode.BLEND: pb.MODE_BLEND,
    Mode.FOCUS: pb.MODE_FOCUS,
}
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()}
_TIER_TO_PB = {
    Tier.GPU: pb.TIER_GPU,
    Tier.CPU: pb.TIER_CPU,
    Tier.DISK: pb.TIER_DISK,
    Tier.S3: pb.TIER_S3,
    Tier.COMPUTED: pb.TIER_COMPUTED,
    Tier.NOT_LOADED: pb.TIER_NOT_LOADED,
    Tier.TREE: pb.TIER_TREE,
    Tier.PEER: pb.TIER_PEER,
}
_TIER_FROM_PB = {v: k for k, v in _TIER_TO_PB.items()}
_SEARCH_TO_PB = {
    SearchMode.DENSE: pb.SEARCH_MODE_DENSE,
    SearchMode.LEXICAL: pb.SEARCH_MODE_LEXICAL,
    SearchMode.HYBRID: pb.SEARCH_MODE_HYBRID,
}
_SEARCH_FROM_PB = {v: k for k, v in _SEARCH_TO_PB.items()}
_OP_TO_PB = {FilterOp.EQUALS: pb.FILTER_OP_EQUALS, FilterOp.PREFIX: pb.FILTER_OP_PREFIX}
_OP_FROM_PB = {v: k for k, v in _OP_TO_PB.items()}
_FINISH_TO_PB = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.STOP: pb.FINISH_REASON_STOP,
                 FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def mode_to_proto(mode: Mode | None) -> int:
    """Mode -> ragkv.v1.Mode number; None -> MODE_UNSPECIFIED."""
    return pb.MODE_UNSPECIFIED if mode is None else _MODE_TO_PB[mode]


def mode_from_proto(value: int, field: str = "mode") -> Mode | None:
    """ragkv.v1.Mode number -> Mode; MODE_UNSPECIFIED -> None.

    Raises:
        WireValueError: The number is no Mode this build knows.
    """
    return _from_proto(_MODE_FROM_PB, pb.Mode, value, field, "mode")


def tier_to_proto(tier: Tier | None) -> int:
    """Tier -> ragkv.v1.Tier number; None -> TIER_UNSPECIFIED."""
    return pb.TIER_UNSPECIFIED if tier is None else _TIER_TO_PB[tier]


def tier_from_proto(value: int, field: str = "kv_tier") -> Tier | None:
    """ragkv.v1.Tier number -> Tier; TIER_UNSPECIFIED -> None."""
    if value == pb.TIER_UNSPECIFIED:
        return None
    try:
        return _TIER_FROM_PB[value]
    except KeyError:
        raise WireValueError(field, f"{field}: unknown tier {value}") from None


def search_mode_to_proto(mode: SearchMode | None) -> int:
    """SearchMode -> ragkv.v1.SearchMode number; None -> SEARCH_MODE_UNSPECIFIED."""
    return pb.SEARCH_MODE_UNSPECIFIED if mode is None else _SEARCH_TO_PB[SearchMode(mode)]


def search_mode_from_proto(value: int, field: str = "search_mode") -> SearchMode | None:
    """ragkv.v1.SearchMode number -> SearchMode; SEARCH_MODE_UNSPECIFIED -> None.

    Raises:
        WireValueError: The number is no SearchMode this build knows.
    """
    return _from_proto(_SEARCH_FROM_PB, pb.SearchMode, value, field, "search mode")


def _from_proto(table: Mapping[int, Any], wire_enum: Any, value: int, field: str, what: str) -> Any:
    """A wire enum number through `table`; 0 (UNSPECIFIED) -> None; an unknown number names the known ones."""
    if value == 0:
        return None
    try:
        return table[value]
    except KeyError:
        known = ", ".join(wire_enum.Name(v) for v in table)
        raise WireValueError(field, f"{field}: unknown {what} {value} (known: {known})") from None


def filters_to_proto(filters: Sequence[MetadataFilter]) -> list[pb.MetadataFilter]:
    """MetadataFilters -> wire filters, each value as JSON text (its type kept)."""
    return [
        pb.MetadataFilter(key=f.key, op=_OP_TO_PB[f.op], value_json=json.dumps(f.value, ensure_ascii=False))
        for f in filters
    ]


def filters_from_proto(msgs: Sequence[pb.MetadataFilter], field: str = "filters") -> tuple[MetadataFilter, ...]:
    """Wire filters -> MetadataFilters.

    Raises:
        WireValueError: A filter has an unknown op, invalid JSON, or a non-string prefix.
    """
    out = []
    for i, m in enumerate(msgs):
        where = f"{field}[{i}]"
        op = FilterOp.EQUALS if m.op == pb.FILTER_OP_UNSPECIFIED else _OP_FROM_PB.get(m.op)
        if op is None:
            raise WireValueError(field, f"{where}.op: unknown filter op {m.op} (known: FILTER_OP_EQUALS, FILTER_OP_PREFIX)")
        try:
            value = json.loads(m.value_json)
        except json.JSONDecodeError as exc:
            raise WireValueError(field, f"{where}.value_json is not JSON ({exc.msg}): {m.value_json[:80]!r}") from None
        try:
            out.append(MetadataFilter(m.key, value, op))
        except ValueError as exc:
            raise WireValueError(field, f"{where}: {exc}") from None
    return tuple(out)


def finish_reason_from_proto(value: int) -> FinishReason:
    """ragkv.v1.FinishReason number -> FinishReason (unknown numbers read as STOP)."""
    return _FINISH_FROM_PB.get(value, FinishReason.STOP)


def query_request_to_proto(question: str, options: QueryOptions) -> pb.QueryRequest:
    """Build the wire request of Query."""
    msg = pb.QueryRequest(
        question=question,
        collection=options.collection or "",
        top_k=options.top_k or 0,
        mode=mode_to_proto(options.mode),
        sampling=pb.SamplingOptions(temperature=options.temperature, top_p=options.top_p or 0.0),
        max_new_tokens=options.max_new_tokens or 0,
        stop=list(options.stop),
        snippet_chars=options.snippet_chars or 0,
        search_mode=search_mode_to_proto(options.search_mode),
        filters=filters_to_proto(options.filters),
    )
    if options.recompute_ratio is not None:
        msg.recompute_ratio = options.recompute_ratio
    if options.fidelity_kl is not None:
        msg.fidelity_kl = options.fidelity_kl
    if options.seed is not None:
        msg.sampling.seed = options.seed
    msg.history.extend(_turns_to_proto(options.history))
    msg.agent_turns.extend(_turns_to_proto(options.agent_turns))
    if options.system_prompt is not None:
        msg.system_prompt = options.system_prompt
    fmt = options.response_format
    if fmt.kind is not ResponseFormatKind.TEXT:
        msg.response_format.CopyFrom(pb.ResponseFormat(
            type=_FORMAT_TO_PB[fmt.kind], schema_json="" if fmt.schema is None else json.dumps(fmt.schema),
            name=fmt.name, strict=fmt.strict))
    msg.tools.extend(pb.Tool(name=t.name, description=t.description, parameters_json=json.dumps(t.parameters))
                     for t in options.tools)
    msg.tool_choice.CopyFrom(pb.ToolChoice(mode=_CHOICE_TO_PB[options.tool_choice.mode],
                                           name=options.tool_choice.name or ""))
    if not options.parallel_tool_calls:
        msg.parallel_tool_calls = False
    msg.citations = options.citations
    msg.cache_salt = options.cache_salt or ""
    if options.retain_seconds is not None:
        msg.retain_seconds = options.retain_seconds
    if options.retain_priority is not None:
        msg.retain_priority = options.retain_priority
    return msg


_CHAT_ROLE_TO_PROTO = {ChatRole.USER: pb.CHAT_ROLE_USER, ChatRole.ASSISTANT: pb.CHAT_ROLE_ASSISTANT,
                       ChatRole.TOOL: pb.CHAT_ROLE_TOOL}
_CHAT_ROLE_FROM_PROTO = {v: k for k, v in _CHAT_ROLE_TO_PROTO.items()}
_FORMAT_TO_PB = {ResponseFormatKind.JSON_OBJECT: pb.RESPONSE_FORMAT_TYPE_JSON_OBJECT,
                 ResponseFormatKind.JSON_SCHEMA: pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA}
_FORMAT_FROM_PB = {v: k for k, v in _FORMAT_TO_PB.items()} | {pb.RESPONSE_FORMAT_TYPE_UNSPECIFIED: ResponseFormatKind.TEXT}
_CHOICE_TO_PB = {ToolChoiceMode.AUTO: pb.TOOL_CHOICE_MODE_AUTO, ToolChoiceMode.NONE: pb.TOOL_CHOICE_MODE_NONE,
                 ToolChoiceMode.REQUIRED: pb.TOOL_CHOICE_MODE_REQUIRED,
                 ToolChoiceMode.FUNCTION: pb.TOOL_CHOICE_MODE_FUNCTION}
_CHOICE_FROM_PB = {v: k for k, v in _CHOICE_TO_PB.items()} | {pb.TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode.AUTO}


def _turns_to_proto(turns: Sequence[ChatTurn]) -> list[pb.ChatTurn]:
    return [pb.ChatTurn(role=_CHAT_ROLE_TO_PROTO[ChatRole(t.role)], content=t.content,
                        tool_calls=[tool_call_to_proto(c) for c in t.tool_calls], tool_call_id=t.tool_call_id or "")
            for t in turns]


def tool_call_to_proto(call: ToolCall) -> pb.ToolCall:
    """ToolCall -> ToolCall message."""
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def tool_call_from_proto(msg: pb.ToolCall) -> ToolCall:
    """ToolCall message -> ToolCall."""
    return ToolCall(msg.id, msg.name, msg.arguments)


def history_from_proto(turns: Sequence[pb.ChatTurn], field: str = "history") -> tuple[ChatTurn, ...]:
    """Wire chat turns -> ChatTurn.

    Raises:
        WireValueError: A turn's role is unspecified or unknown.
    """
    out = []
    for i, t in enumerate(turns):
        role = _CHAT_ROLE_FROM_PROTO.get(t.role)
        if role is None:
            raise WireValueError(f"{field}[{i}].role", f"{field}[{i}].role: must be CHAT_ROLE_USER, "
                                                       f"CHAT_ROLE_ASSISTANT or CHAT_ROLE_TOOL, got {t.role}")
        out.append(ChatTurn(role, t.content, tuple(tool_call_from_proto(c) for c in t.tool_calls),
                            t.tool_call_id or None))
    return tuple(out)


def _json_field(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WireValueError(field, f"{field}: is not valid JSON ({exc})") from None


def output_options_from_proto(msg: pb.QueryRequest) -> dict[str, Any]:
    """The answer-shape fields of a Query request, as QueryOptions keyword arguments.

    Raises:
        WireValueError: A schema is not JSON, or an enum number is unknown.
    """
    fmt = msg.response_format
    kind = _FORMAT_FROM_PB.get(fmt.type)
    if kind is None:
        raise WireValueError("response_format.type", f"response_format.type: unknown value {fmt.type}")
    schema = _json_field(fmt.schema_json, "response_format.schema_json") if fmt.schema_json else None
    tools = tuple(Tool(t.name, t.description, _json_field(t.parameters_json, f"tools[{i}].parameters_json")
                       if t.parameters_json else {"type": "object", "properties": {}})
                  for i, t in enumerate(msg.tools))
    mode = _CHOICE_FROM_PB.get(msg.tool_choice.mode)
    if mode is None:
        raise WireValueError("tool_choice.mode", f"tool_choice.mode: unknown value {msg.tool_choice.mode}")
    return dict(
        agent_turns=history_from_proto(msg.agent_turns, "agent_turns"),
        response_format=ResponseFormat(kind, schema, fmt.name, fmt.strict),
        tools=tools,
        tool_choice=ToolChoice(mode, msg.tool_choice.name or None),
        parallel_tool_calls=msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True,
        citations=msg.citations,
        cache_salt=msg.cache_salt or None,
        retain_seconds=msg.retain_seconds if msg.HasField("retain_seconds") else None,
        retain_priority=msg.retain_priority if msg.HasField("retain_priority") else None,
    )


def query_request_from_proto(msg: pb.QueryRequest) -> tuple[str, QueryOptions]:
    """Read a Query request into (question, options); zero values become None.

    Raises:
        WireValueError: `mode` holds an unknown enum number.
    """
    sampling = msg.sampling
    options = QueryOptions(
        collection=msg.collection or None,
        top_k=msg.top_k or None,
        mode=mode_from_proto(msg.mode),
        recompute_ratio=msg.recompute_ratio if msg.HasField("recompute_ratio") else None,
        fidelity_kl=msg.fidelity_kl if msg.HasField("fidelity_kl") else None,
        temperature=sampling.temperature,
        top_p=sampling.top_p or None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens or None,
        stop=tuple(msg.stop),
        snippet_chars=msg.snippet_chars or None,
        search_mode=search_mode_from_proto(msg.search_mode),
        filters=filters_from_proto(msg.filters),
        history=history_from_proto(msg.history),
        system_prompt=msg.system_prompt if msg.HasField("system_prompt") else None,
        **output_options_from_proto(msg),
    )
    return msg.question, options


def retrieve_request_to_proto(
    question: str, collection: str | None, top_k: int | None, snippet_chars: int | None,
    search_mode: SearchMode | None = None, filters: Sequence[MetadataFilter] = (),
) -> pb.RetrieveRequest:
    """Build the wire request of Retrieve."""
    return pb.RetrieveRequest(
        question=question, collection=collection or "", top_k=top_k or 0, snippet_chars=snippet_chars or 0,
        search_mode=search_mode_to_proto(search_mode), filters=filters_to_proto(filters),
    )


def retrieve_request_from_proto(msg: pb.RetrieveRequest) -> tuple[str, QueryOptions]:
    """Read a Retrieve request into (question, options) with only the retrieval fields set.

    Raises:
        WireValueError: `search_mode` or a filter holds a value this build cannot read.
    """
    options = QueryOptions(
        collection=msg.collection or None, top_k=msg.top_k or None, snippet_chars=msg.snippet_chars or None,
        search_mode=search_mode_from_proto(msg.search_mode), filters=filters_from_proto(msg.filters),
    )
    return msg.question, options


def _snippet(text: str, snippet_chars: int | None) -> str:
    return text if not snippet_chars else text[:snippet_chars]


def chunk_to_proto(chunk: RetrievedChunk, snippet_chars: int | None = None) -> pb.Chunk:
    """RetrievedChunk -> Chunk, the text cut to snippet_chars when given."""
    return pb.Chunk(
        chunk_id=chunk.chunk_id,
        score=chunk.score,
        text=_snippet(chunk.text, snippet_chars),
        metadata=metadata_to_wire(chunk.metadata),
        kv_tier=tier_to_proto(chunk.kv_tier),
        num_tokens=chunk.num_tokens,
        metadata_json=json.dumps(dict(chunk.metadata), ensure_ascii=False, default=str) if chunk.metadata else "",
        found_by=[search_mode_to_proto(m) for m in chunk.found_by],
    )


def chunk_from_proto(msg: pb.Chunk) -> RetrievedChunk:
    """Chunk -> RetrievedChunk."""
    return RetrievedChunk(
        chunk_id=msg.chunk_id,
        score=msg.score,
        text=msg.text,
        metadata=metadata_from_wire(msg.metadata_json, msg.metadata),
        kv_tier=tier_from_proto(msg.kv_tier),
        num_tokens=msg.num_tokens,
        found_by=tuple(m for v in msg.found_by if (m := _SEARCH_FROM_PB.get(v)) is not None),
    )


def retrieve_result_to_proto(result: RetrieveResult, snippet_chars: int | None = None) -> pb.RetrieveResponse:
    """RetrieveResult -> RetrieveResponse."""
    return pb.RetrieveResponse(
        chunks=[chunk_to_proto(c, snippet_chars) for c in result.chunks],
        retrieve_seconds=result.retrieve_seconds,
    )


def retrieve_result_from_proto(msg: pb.RetrieveResponse) -> RetrieveResult:
    """RetrieveResponse -> RetrieveResult."""
    return RetrieveResult(
        chunks=tuple(chunk_from_proto(c) for c in msg.chunks), retrieve_seconds=msg.retrieve_seconds
    )


def query_stats_to_proto(stats: QueryStats) -> pb.QueryStats:
    """QueryStats -> QueryStats message."""
    return pb.QueryStats(
        usage=pb.Usage(
            prompt_tokens=stats.usage.prompt_tokens,
            completion_tokens=stats.usage.completion_tokens,
            cached_prompt_tokens=stats.usage.cached_prompt_tokens,
            tree_prompt_tokens=stats.usage.tree_prompt_tokens,
        ),
        ttft_seconds=stats.ttft_seconds,
        total_seconds=stats.total_seconds,
        phase_seconds=dict(stats.phase_seconds),
        recompute_fraction=stats.recompute_fraction,
        mode=mode_to_proto(stats.mode),
        finish_reason=_FINISH_TO_PB[stats.finish_reason],
        text=stats.text,
        used_chunk_ids=list(stats.used_chunk_ids),
        kv_sources={k.value: v for k, v in stats.kv_sources.items()},
        tool_calls=[tool_call_to_proto(c) for c in stats.tool_calls],
        citations=[pb.Citation(number=c.number, chunk_id=c.chunk_id, start=c.start, end=c.end,
                               sentence_start=c.sentence_start) for c in stats.citations],
        focus=None if stats.focus is None else pb.FocusSignal(
            handed_over=stats.focus.handed_over, kept_attention=stats.focus.kept_attention, spread=stats.focus.spread),
        system_prompt=stats.system_prompt.value,
        length_limit="" if stats.length_limit is None else stats.length_limit.value,
        recompute_ratio=stats.recompute_ratio, predicted_kl=stats.predicted_kl,
    )


def query_stats_from_proto(msg: pb.QueryStats) -> QueryStats:
    """QueryStats message -> QueryStats."""
    mode = mode_from_proto(msg.mode, field="stats.mode")
    return QueryStats(
        usage=Usage(
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            cached_prompt_tokens=msg.usage.cached_prompt_tokens,
            tree_prompt_tokens=msg.usage.tree_prompt_tokens,
        ),
        ttft_seconds=msg.ttft_seconds,
        total_seconds=msg.total_seconds,
        phase_seconds=dict(msg.phase_seconds),
        recompute_fraction=msg.recompute_fraction,
        mode=mode if mode is not None else Mode.BLEND,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        text=msg.text,
        used_chunk_ids=tuple(msg.used_chunk_ids),
        kv_sources=_kv_sources_from_proto(msg.kv_sources),
        tool_calls=tuple(tool_call_from_proto(c) for c in msg.tool_calls),
        citations=tuple(Citation(c.number, c.chunk_id, c.start, c.end, c.sentence_start) for c in msg.citations),
        focus=FocusSignal(msg.focus.handed_over, msg.focus.kept_attention, msg.focus.spread)
        if msg.HasField("focus") else None,
        system_prompt=_known(SystemPromptPath, msg.system_prompt, SystemPromptPath.INDEXED),
        length_limit=_known(LengthLimit, msg.length_limit, None),
        recompute_ratio=msg.recompute_ratio if msg.HasField("recompute_ratio") else None,
        predicted_kl=msg.predicted_kl if msg.HasField("predicted_kl") else None,
    )


def _known(kind: type[_E], value: str, default: _D) -> _E | _D:
    """`value` as a member of `kind`, or `default` when unset or unknown (a newer server's)."""
    try:
        return kind(value) if value else default
    except ValueError:
        return default


def _kv_sources_from_proto(counts: Mapping[str, int]) -> dict[KVSource, int]:
    """The wire's map, keeping only the sources this client knows (a newer server may add some)."""
    known = {s.value: s for s in KVSource}
    return {known[k]: int(v) for k, v in counts.items() if k in known}


def chunks_response(chunks: tuple[RetrievedChunk, ...], snippet_chars: int | None = None) -> pb.QueryResponse:
    """The first message of a Query stream."""
    return pb.QueryResponse(chunks=pb.RetrievedChunks(chunks=[chunk_to_proto(c, snippet_chars) for c in chunks]))


def token_response(text: str, index: int) -> pb.QueryResponse:
    """One token-piece message of a Query stream."""
    return pb.QueryResponse(token=pb.TokenDelta(text=text, index=index))


def tool_call_response(delta: ToolCallDelta) -> pb.QueryResponse:
    """One tool-call piece of a Query stream."""
    return pb.QueryResponse(tool_call=pb.ToolCallDelta(index=delta.index, id=delta.id or "", name=delta.name or "",
                                                       arguments=delta.arguments))


def stats_response(stats: QueryStats) -> pb.QueryResponse:
    """The last message of a Query stream."""
    return pb.QueryResponse(stats=query_stats_to_proto(stats))


QueryEvent = tuple[RetrievedChunk, ...] | str | ToolCallDelta | QueryStats


def query_event_from_proto(msg: pb.QueryResponse) -> QueryEvent:
    """A Query stream message -> chunks tuple, token text, tool-call piece, or QueryStats.

    Raises:
        WireValueError: The message carries none of the known events.
    """
    which = msg.WhichOneof("event")
    if which == "chunks":
        return tuple(chunk_from_proto(c) for c in msg.chunks.chunks)
    if which == "token":
        return msg.token.text
    if which == "stats":
        return query_stats_from_proto(msg.stats)
    if which == "tool_call":
        d = msg.tool_call
        return ToolCallDelta(d.index, d.id or None, d.name or None, d.arguments)
    raise WireValueError("event", f"event: QueryResponse carries no known event ({which!r})")


def collection_to_proto(info: CollectionInfo) -> pb.Collection:
    """CollectionInfo -> Collection."""
    return pb.Collection(
        name=info.name,
        num_chunks=info.num_chunks,
        model_fingerprint=info.model_fingerprint,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
    )


def collection_from_proto(msg: pb.Collection) -> CollectionInfo:
    """Collection -> CollectionInfo."""
    return CollectionInfo(
        name=msg.name,
        num_chunks=msg.num_chunks,
        model_fingerprint=msg.model_fingerprint,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
    )


def collection_stats_to_proto(stats: CollectionStats) -> pb.GetCollectionStatsResponse:
    """CollectionStats -> GetCollectionStatsResponse."""
    return pb.GetCollectionStatsResponse(
        collection=collection_to_proto(stats.collection),
        tiers=[tier_stats_to_proto(t) for t in stats.tiers],
    )


def tier_stats_to_proto(t: TierStats) -> pb.TierStats:
    """TierStats -> TierStats message (bytes_used and bytes_read go by their wire names)."""
    msg = pb.TierStats(
        tier=tier_to_proto(t.tier), entries=t.entries, bytes=t.bytes_used, hits=t.hits, misses=t.misses,
        bytes_loaded=t.bytes_read, rejected=t.rejected, errors=t.errors, puts=t.puts, refused=t.refused,
        evictions=t.evictions, bytes_written=t.bytes_written, get_seconds=t.get_seconds,
        put_seconds=t.put_seconds, max_get_seconds=t.max_get_seconds,
    )
    if t.budget_bytes is not None:
        msg.budget_bytes = t.budget_bytes
    return msg


def collection_stats_from_proto(msg: pb.GetCollectionStatsResponse) -> CollectionStats:
    """GetCollectionStatsResponse -> CollectionStats."""
    tiers = []
    for t in msg.tiers:
        tier = tier_from_proto(t.tier, field="tiers.tier")
        if tier is None:
            raise WireValueError("tiers.tier", "tiers.tier: TIER_UNSPECIFIED in collection stats")
        tiers.append(TierStats(
            tier, hits=t.hits, misses=t.misses, rejected=t.rejected, errors=t.errors, puts=t.puts, refused=t.refused,
            evictions=t.evictions, bytes_read=t.bytes_loaded, bytes_written=t.bytes_written, entries=t.entries,
            bytes_used=t.bytes, budget_bytes=t.budget_bytes if t.HasField("budget_bytes") else None,
            get_seconds=t.get_seconds, put_seconds=t.put_seconds, max_get_seconds=t.max_get_seconds))
    return CollectionStats(collection=collection_from_proto(msg.collection), tiers=tuple(tiers))


def metadata_to_wire(metadata: Mapping[str, object]) -> dict[str, str]:
    """Flatten chunk metadata to the wire's string map (non-strings as JSON)."""
    return {str(k): v if isinstance(v, str) else json.dumps(v, default=str) for k, v in metadata.items()}


def metadata_from_wire(metadata_json: str, flat: Mapping[str, str]) -> dict[str, Any]:
    """A chunk's metadata with its JSON types: from ``metadata_json`` when the server sent it,
    else the flat string map (an older server)."""
    if metadata_json:
        try:
            obj = json.loads(metadata_json)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return obj
    return dict(flat)
