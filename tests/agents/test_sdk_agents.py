"""The Python SDK's agent options over gRPC: tool calls stream as ToolCallDelta pieces and
end as QueryStats.tool_calls; a response format holds the answer to its schema; a bad
schema is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from ragkv.client import AsyncRagClient, RagClient
from ragkv.types import FinishReason, Tool, ToolCallDelta
from tests.server.fakes import ServerThread

pytestmark = pytest.mark.real_model

WEATHER = Tool("get_weather", "Get the current weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_tool_calls_stream_as_deltas_and_end_in_the_stats(smol_server: ServerThread) -> None:
    with RagClient(smol_server.addr, timeout=120) as client:
        stream = client.query("What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                              max_new_tokens=48)
        pieces = list(stream)
        stats = stream.result()
    assert pieces and all(isinstance(p, ToolCallDelta) for p in pieces)
    assert stats.finish_reason is FinishReason.TOOL_CALLS and stats.text == ""
    (call,) = stats.tool_calls
    assert pieces[0].id == call.id and pieces[0].name == "get_weather"
    assert "".join(p.arguments for p in pieces) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER.parameters)


def test_openai_style_tool_dicts_and_named_choice_async(smol_server: ServerThread) -> None:
    import asyncio

    tool = {"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                             "parameters": dict(WEATHER.parameters)}}

    async def go():
        async with AsyncRagClient(smol_server.addr, timeout=120) as client:
            stream = client.query("Weather in Rome?", tools=[tool], tool_choice="get_weather",
                                  parallel_tool_calls=False, max_new_tokens=48)
            return [p async for p in stream], stream.stats

    pieces, stats = asyncio.run(go())
    assert [c.name for c in stats.tool_calls] == ["get_weather"] and pieces


def test_response_format_schema_holds_the_answer(smol_server: ServerThread) -> None:
    with RagClient(smol_server.addr, timeout=120) as client:
        stats = client.query("Alice is 31. Give her as JSON.", response_format=PERSON, max_new_tokens=48).result()
        obj = client.query("Anything as JSON.", response_format="json_object", max_new_tokens=48).result()
    jsonschema.validate(json.loads(stats.text), PERSON)
    assert isinstance(json.loads(obj.text), dict)


def test_a_bad_schema_is_invalid_argument_naming_the_field(smol_server: ServerThread) -> None:
    with RagClient(smol_server.addr, timeout=60) as client, pytest.raises(grpc.RpcError) as info:
        client.query("q?", response_format={"type": "object", "properties": {"a": {"type": "wibble"}}}).result()
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format.json_schema" in info.value.details() and "wibble" in info.value.details()
