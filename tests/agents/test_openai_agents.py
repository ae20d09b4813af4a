"""Structured output, tool calls and cited answers through the OpenAI API, on SmolLM2.

What is asserted is the interface and what the grammar guarantees (the output parses
and validates against its schema, calls name given tools, streamed calls reassemble to
the same calls), never the model's judgement: the 135M model's argument values and
whether it chooses to call a tool under "auto" are its own.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.fakes import ServerThread

pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, MULTIPLY]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def _client(st: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _ask(st: ServerThread, question: str = "What is the weather in Paris?", **kw):
    kw.setdefault("max_tokens", 48)
    return _client(st).chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                                **kw)


def _check_calls(message) -> list[tuple[str, dict]]:
    """Every call names a given tool and its arguments validate against that tool's schema."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_json_object_always_parses(smol_server: ServerThread) -> None:
    r = _ask(smol_server, "Describe Paris as JSON.", response_format={"type": "json_object"}, max_tokens=96)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_parses_and_validates(smol_server: ServerThread, strict: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}
    r = _ask(smol_server, "Alice is 31 and lives in Paris. Give her as JSON.", response_format=fmt, max_tokens=96)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_text_response_format_is_free_text(smol_server: ServerThread) -> None:
    free = _ask(smol_server, "What is the secret number?")
    text = _ask(smol_server, "What is the secret number?", response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


@pytest.mark.parametrize(("kwargs", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "wibble"}}}}}}, "response_format.json_schema", "wibble"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "(("}}}}}]},
     "tools[0].function.parameters", "unclosed"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "bad name!"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", "sometimes"),
    ({"extra_body": {"citations": True}, "response_format": {"type": "json_object"}}, "citations", "JSON"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_bad_output_options_are_400_naming_the_field(smol_server: ServerThread, kwargs: dict, param: str,
                                                     needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(smol_server, **kwargs)
    assert info.value.body["param"] == param and needle in info.value.body["message"], info.value.body


def test_tool_choice_required_calls_given_tools(smol_server: ServerThread) -> None:
    r = _ask(smol_server, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _check_calls(choice.message)


def test_tool_choice_named_calls_that_tool_once(smol_server: ServerThread) -> None:
    r = _ask(smol_server, "What is 6 times 7?", tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "multiply"}})
    calls = _check_calls(r.choices[0].message)
    assert [name for name, _ in calls] == ["multiply"] and r.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(smol_server: ServerThread) -> None:
    r = _ask(smol_server, tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_tool_choice_auto_is_either_text_or_valid_calls(smol_server: ServerThread) -> None:
    for question in ("What is the weather in Paris?", "What is the secret number?", "What is 6 times 7?"):
        r = _ask(smol_server, question, tools=TOOLS)  # auto: the model decides, the grammar holds it
        msg = r.choices[0].message
        if msg.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and _check_calls(msg)
        else:
            assert msg.content and not msg.content.lstrip().startswith("<tool_call>")


def test_parallel_tool_calls_false_makes_one_call(smol_server: ServerThread) -> None:
    r = _ask(smol_server, "Weather in Paris and in Berlin?", tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False, max_tokens=96)
    assert len(_check_calls(r.choices[0].message)) == 1


def test_a_tool_message_history_is_answered(smol_server: ServerThread) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and 21 degrees."},
    ]
    r = _client(smol_server).chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                                      tool_choice="none", max_tokens=32)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    auto = _client(smol_server).chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                                         max_tokens=48)
    assert auto.choices[0].message.content or _check_calls(auto.choices[0].message)


def test_streamed_tool_calls_reassemble_to_the_unstreamed_calls(smol_server: ServerThread) -> None:
    kw = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 96}
    whole = _ask(smol_server, "Weather in Paris, and 6 times 7?", **kw)
    stream = _ask(smol_server, "Weather in Paris, and 6 times 7?", stream=True, **kw)
    calls: dict[int, dict] = {}
    finish, contents = None, []
    for chunk in stream:
        choice = chunk.choices[0]
        contents.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and not "".join(contents)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_tools_leave_the_chunk_keys_and_the_context_unchanged(smol_server: ServerThread) -> None:
    """Tools and their results go after the chunks: the same chunks, the same KV keys, and
    the same token ids before the question segment."""
    import dataclasses

    from ragkv.engine.decode import SamplingParams
    from ragkv.server.query import Query
    from ragkv.types import ChatRole, ChatTurn, Mode, Tool, ToolCall, ToolChoice, ToolChoiceMode

    backend = smol_server.server.service.backend
    base = Query("What is the weather in Paris?", "default", 2, Mode.BLEND, 0.15, SamplingParams(max_new_tokens=16))
    tool = Tool("get_weather", "weather", SCHEMAS["get_weather"])
    with_tools = dataclasses.replace(
        base, tools=(tool,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
        agent_turns=(ChatTurn(ChatRole.ASSISTANT, "", (ToolCall("c1", "get_weather", "{}"),)),
                     ChatTurn(ChatRole.TOOL, "sunny", tool_call_id="c1")))
    pa, pb = backend.prepare(base), backend.prepare(with_tools)
    assert [c.chunk_id for c in pa.chunks] == [c.chunk_id for c in pb.chunks]
    a, b = pa.request, pb.request
    assert [c.key for c in a.chunks] == [c.key for c in b.chunks]
    assert [c.token_ids for c in a.chunks] == [c.token_ids for c in b.chunks]
    assert a.prefix_ids == b.prefix_ids
    assert a.constraint is None and b.constraint is not None
