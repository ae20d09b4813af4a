"""ragkv.convert: every field of every message survives a round trip."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from ragkv import convert
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

CHUNK = RetrievedChunk("c1", 0.5, "some text", {"source": "a.txt", "page": 3, "ok": True, "tags": ["x"]},
                       Tier.DISK, 7, (SearchMode.DENSE, SearchMode.LEXICAL))
FILTERS = (MetadataFilter("year", 2024), MetadataFilter("source", "docs/", FilterOp.PREFIX),
           MetadataFilter("ok", True), MetadataFilter("tag", None))
STATS = QueryStats(Usage(100, 5, 80, 60), 0.25, 1.5, {"retrieve": 0.01, "decode": 1.0}, 0.15, Mode.FOCUS,
                   FinishReason.LENGTH, "an answer", ("c1", "c3"),
                   {KVSource.LOADED: 3, KVSource.COMPUTED_CHEAPER: 1},
                   (ToolCall("call_1", "lookup", '{"q":"x"}'),), (Citation(2, "c3", 10, 13, 0),),
                   FocusSignal(True, 0.75, 0.5), SystemPromptPath.PREFIX, LengthLimit.CONTEXT, 0.2, 0.0)
CALL = ToolCall("call_0", "lookup", '{"q": "earlier"}')


def _all_fields_set(msg: Message) -> list[str]:
    """Names of fields left at their default (recursively)."""
    missing = []
    for fd in msg.DESCRIPTOR.fields:
        if fd.message_type is not None and not fd.is_repeated:
            if not msg.HasField(fd.name):
                missing.append(fd.name)
            else:
                missing += [f"{fd.name}.{m}" for m in _all_fields_set(getattr(msg, fd.name))]
        elif not getattr(msg, fd.name) and not (fd.has_presence and msg.HasField(fd.name)):
            missing.append(fd.name)
    return missing


def test_query_request_round_trip() -> None:
    options = QueryOptions("docs", 3, Mode.REUSE, 0.0, 0.75, 0.5, 42, 16, ("\n\n",), 100, SearchMode.LEXICAL,
                           FILTERS, (ChatTurn(ChatRole.USER, "hi"), ChatTurn(ChatRole.ASSISTANT, "hello")), "Be brief.",
                           agent_turns=(ChatTurn(ChatRole.ASSISTANT, "", (CALL,)),
                                        ChatTurn(ChatRole.TOOL, "42", tool_call_id="call_0")),
                           response_format=ResponseFormat(ResponseFormatKind.JSON_SCHEMA, {"type": "object"}, "out", True),
                           tools=(Tool("lookup", "Look it up", {"type": "object", "properties": {"q": {"type": "string"}}}),),
                           tool_choice=ToolChoice(ToolChoiceMode.FUNCTION, "lookup"), parallel_tool_calls=False,
                           citations=True, cache_salt="user-42", retain_seconds=0.0, retain_priority=0,
                           fidelity_kl=0.01)
    msg = convert.query_request_to_proto("why?", options)
    assert _all_fields_set(msg) == []
    assert msg.HasField("recompute_ratio")  # 0.0 is an explicit value, not "unset"
    assert msg.HasField("retain_seconds")  # 0 s (no pin) is asked for, not "the server's learned"
    assert msg.HasField("retain_priority")  # 0 is asked for explicitly
    assert convert.query_request_from_proto(msg) == ("why?", options)


def test_history_role_unspecified_is_a_wire_error() -> None:
    msg = pb.QueryRequest(question="q", history=[pb.ChatTurn(role=pb.CHAT_ROLE_UNSPECIFIED, content="x")])
    with pytest.raises(convert.WireValueError, match=r"history\[0\]\.role"):
        convert.query_request_from_proto(msg)


def test_query_request_unset_means_server_default() -> None:
    question, options = convert.query_request_from_proto(convert.query_request_to_proto("q", QueryOptions()))
    assert (question, options) == ("q", QueryOptions())


def test_chunk_stats_and_retrieve_round_trip() -> None:
    msg = convert.chunk_to_proto(CHUNK)
    assert _all_fields_set(msg) == []
    assert convert.chunk_from_proto(msg) == CHUNK
    assert convert.chunk_to_proto(CHUNK, snippet_chars=4).text == "some"
    smsg = convert.query_stats_to_proto(STATS)
    assert _all_fields_set(smsg) == []
    assert convert.query_stats_from_proto(smsg) == STATS
    result = RetrieveResult((CHUNK,), 0.02)
    rmsg = convert.retrieve_result_to_proto(result)
    assert _all_fields_set(rmsg) == []
    assert convert.retrieve_result_from_proto(rmsg) == result


def test_collection_round_trip() -> None:
    stats = CollectionStats(CollectionInfo("docs", 10, "m", "t"),
                            (TierStats(Tier.CPU, *range(1, 12), 1 << 30, 0.5, 0.25, 0.125),))
    msg = convert.collection_stats_to_proto(stats)
    assert _all_fields_set(msg) == []
    assert convert.collection_stats_from_proto(msg) == stats


def test_bad_schema_json_is_a_wire_error() -> None:
    msg = pb.QueryRequest(question="q", tools=[pb.Tool(name="t", parameters_json="{not json")])
    with pytest.raises(convert.WireValueError, match=r"tools\[0\]\.parameters_json"):
        convert.query_request_from_proto(msg)


def test_tool_call_delta_event() -> None:
    first, later = ToolCallDelta(1, "call_9", "lookup", ""), ToolCallDelta(1, None, None, '{"q":')
    assert convert.query_event_from_proto(convert.tool_call_response(first)) == first
    assert convert.query_event_from_proto(convert.tool_call_response(later)) == later


def test_stream_events() -> None:
    assert convert.query_event_from_proto(convert.chunks_response((CHUNK,))) == (CHUNK,)
    assert convert.query_event_from_proto(convert.token_response("hi", 0)) == "hi"
    assert convert.query_event_from_proto(convert.stats_response(STATS)) == STATS
    with pytest.raises(convert.WireValueError, match="no known event"):
        convert.query_event_from_proto(pb.QueryResponse())


def test_every_enum_value_maps() -> None:
    for mode in Mode:
        assert convert.mode_from_proto(convert.mode_to_proto(mode)) is mode
    for tier in Tier:
        assert convert.tier_from_proto(convert.tier_to_proto(tier)) is tier
    assert len(Mode) == len(pb.Mode.values()) - 1 and len(Tier) == len(pb.Tier.values()) - 1
    with pytest.raises(convert.WireValueError) as err:
        convert.mode_from_proto(42)
    assert err.value.field == "mode" and "42" in str(err.value)


def test_metadata_to_wire() -> None:
    assert convert.metadata_to_wire({"a": "x", "page": 3, "tags": ["p", "q"]}) == {
        "a": "x", "page": "3", "tags": '["p", "q"]'}


def test_metadata_keeps_json_types_end_to_end() -> None:
    msg = convert.chunk_to_proto(CHUNK)
    assert dict(msg.metadata) == {"source": "a.txt", "page": "3", "ok": "true", "tags": '["x"]'}  # older clients
    back = convert.chunk_from_proto(msg).metadata
    assert back == {"source": "a.txt", "page": 3, "ok": True, "tags": ["x"]}
    assert type(back["page"]) is int and type(back["ok"]) is bool
    old_server = pb.Chunk(chunk_id="c", metadata={"source": "a"})  # no metadata_json: the flat map
    assert convert.chunk_from_proto(old_server).metadata == {"source": "a"}


def test_retrieve_request_search_fields_round_trip() -> None:
    msg = convert.retrieve_request_to_proto("q", "docs", 2, 10, SearchMode.HYBRID, FILTERS)
    assert _all_fields_set(msg) == []
    question, options = convert.retrieve_request_from_proto(msg)
    assert options.search_mode is SearchMode.HYBRID and options.filters == FILTERS
    assert type(options.filters[0].value) is int and options.filters[2].value is True
    for mode in SearchMode:
        assert convert.search_mode_from_proto(convert.search_mode_to_proto(mode)) is mode
    assert len(SearchMode) == len(pb.SearchMode.values()) - 1


def test_bad_wire_filters_name_the_field() -> None:
    bad_json = pb.RetrieveRequest(question="q", filters=[pb.MetadataFilter(key="a", value_json="{nope")])
    with pytest.raises(convert.WireValueError, match=r"filters\[0\].value_json is not JSON") as err:
        convert.retrieve_request_from_proto(bad_json)
    assert err.value.field == "filters"
    bad_prefix = pb.QueryRequest(question="q", filters=[pb.MetadataFilter(key="a", op=pb.FILTER_OP_PREFIX,
                                                                          value_json="3")])
    with pytest.raises(convert.WireValueError, match="needs a str value"):
        convert.query_request_from_proto(bad_prefix)
    with pytest.raises(convert.WireValueError, match="unknown search mode 9"):
        convert.query_request_from_proto(pb.QueryRequest(question="q", search_mode=9))


def test_kv_sources_a_newer_server_adds_are_dropped_not_fatal() -> None:
    smsg = convert.query_stats_to_proto(STATS)
    smsg.kv_sources["computed_by_magic"] = 2
    assert convert.query_stats_from_proto(smsg).kv_sources == STATS.kv_sources
