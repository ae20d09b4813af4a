"""OpenAI's Responses API (`/v1/responses`), driven by the official `openai` client and the
OpenAI Agents SDK against a live server on loopback over the fake backend: what each request
becomes (the Query the backend prepares), stored conversations, streaming events, and that
one API key never sees another's responses."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
from pathlib import Path

import openai
import pytest

from ragkv.engine.request import Request
from ragkv.server.backend import Prepared
from ragkv.server.query import Query
from ragkv.server.response_store import ResponseStore
from ragkv.types import (
    ChatRole,
    ChatTurn,
    ResponseFormat,
    ResponseFormatKind,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from tests.server.fakes import FakeBackend, ServerThread, settings

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


class RecordingBackend(FakeBackend):
    """The fake, recording each Query; asked with tools (and no tool results yet) about the
    weather, it calls the first tool, as a model would: `<tool_call>` text the server parses."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.params: list[Query] = []

    def prepare(self, query: Query, hits: object = None) -> Prepared:
        self.params.append(query)
        prepared = super().prepare(query, hits)
        prepared.request.reads_tool_calls = bool(query.tools) and query.tool_choice.mode is not ToolChoiceMode.NONE
        return prepared

    def _words(self, request: Request) -> list[str]:
        query = self.asked[request]
        if not request.reads_tool_calls or query.agent_turns or "weather" not in query.question:
            return super()._words(request)
        call = json.dumps({"name": query.tools[0].name, "arguments": {"city": "Paris"}})
        text = f"<tool_call>\n{call}\n</tool_call>"
        return [text[i:i + 7] for i in range(0, len(text), 7)][:request.sampling.max_new_tokens]


@pytest.fixture(scope="module")
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture(scope="module")
def http_server(backend: RecordingBackend):
    st = ServerThread(settings(http_port=0), lambda _: backend)
    yield st
    st.stop()


def _url(st: ServerThread) -> str:
    return f"http://127.0.0.1:{st.server.http_port}/v1"


def _client(st: ServerThread, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(st), api_key=api_key, max_retries=0, timeout=10)


def test_text_in_text_out_with_usage_and_sources(http_server: ServerThread, backend: RecordingBackend) -> None:
    r = _client(http_server).responses.create(model="default", input="alpha beta gamma",
                                              extra_body={"top_k": 3, "mode": "blend"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == "default" and r.error is None and r.incomplete_details is None
    assert r.output_text == "alpha beta gamma "
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage.input_tokens == 10 + 12 * 3 and r.usage.input_tokens_details.cached_tokens == 12 * 3
    assert r.usage.output_tokens == 3 and r.usage.total_tokens == 10 + 12 * 3 + 3
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is True and r.previous_response_id is None and r.tools == [] and r.tool_choice == "auto"
    assert len(r.model_extra["ragkv"]["sources"]) == 3
    q = backend.params[-1]
    assert q.question == "alpha beta gamma" and q.top_k == 3 and q.history == () and q.system_prompt is None


def test_instructions_sampling_and_the_length_limit(http_server: ServerThread, backend: RecordingBackend) -> None:
    r = _client(http_server).responses.create(
        model="default", instructions="You answer from the context.", max_output_tokens=2, temperature=0.5,
        top_p=0.9, input=[{"role": "developer", "content": "Be brief."},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two three"}]}])
    q = backend.params[-1]
    assert q.system_prompt == "You answer from the context.\n\nBe brief." and q.question == "one two three"
    assert (q.sampling.max_new_tokens, q.sampling.temperature, q.sampling.top_p) == (2, 0.5, 0.9)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "one two " and r.max_output_tokens == 2 and r.instructions == "You answer from the context."


def test_a_conversation_through_previous_response_id(http_server: ServerThread, backend: RecordingBackend) -> None:
    client = _client(http_server)
    first = client.responses.create(model="default", input="who wrote it")
    second = client.responses.create(model="default", input="alpha beta", previous_response_id=first.id)
    assert second.output_text == "alpha beta " and second.previous_response_id == first.id
    assert backend.params[-1].history == (ChatTurn(ChatRole.USER, "who wrote it"),
                                          ChatTurn(ChatRole.ASSISTANT, "who wrote it "))
    client.responses.create(model="default", previous_response_id=second.id,
                            input=[{"role": "user", "content": [{"type": "input_text", "text": "gamma"}]}])
    q = backend.params[-1]
    assert q.question == "gamma" and [t.content for t in q.history] == ["who wrote it", "who wrote it ", "alpha beta",
                                                                        "alpha beta "]


def test_function_tools_and_their_outputs_become_the_querys_tools_and_agent_turns(
        http_server: ServerThread, backend: RecordingBackend) -> None:
    client = _client(http_server)
    r = client.responses.create(
        model="default", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        input=[{"role": "user", "content": "is it warm"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 25C"}])
    q = backend.params[-1]
    assert q.tools == (Tool("get_weather", "The weather in a city.", WEATHER["parameters"]),)
    assert q.tool_choice == ToolChoice(ToolChoiceMode.FUNCTION, "get_weather") and q.parallel_tool_calls is False
    assert q.question == "is it warm"
    assert q.agent_turns == (ChatTurn(ChatRole.ASSISTANT, "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
                             ChatTurn(ChatRole.TOOL, "sunny, 25C", tool_call_id="call_1"))
    assert r.output_text == "is it warm " and r.tools[0].name == "get_weather" and r.parallel_tool_calls is False


def test_a_model_tool_call_is_a_function_call_item_and_its_output_continues(
        http_server: ServerThread, backend: RecordingBackend) -> None:
    client = _client(http_server)
    r = client.responses.create(model="default", input="the weather in Paris", tools=[WEATHER])
    [call] = r.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    done = client.responses.create(model="default", previous_response_id=r.id, tools=[WEATHER],
                                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    q = backend.params[-1]
    assert q.question == "the weather in Paris" and q.history == ()
    assert q.agent_turns == (ChatTurn(ChatRole.ASSISTANT, "", (ToolCall(call.call_id, "get_weather", call.arguments),)),
                             ChatTurn(ChatRole.TOOL, "sunny", tool_call_id=call.call_id))
    assert done.output_text == "the weather in Paris "


def test_streaming_text_events_in_order(http_server: ServerThread) -> None:
    client = _client(http_server)
    events = list(client.responses.create(model="default", input="one two three", stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "one two three "
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:9])
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "one two three " and final.output[0].id == item_id
    assert final.usage.output_tokens == 3 and final.model_extra["ragkv"]["sources"]
    assert client.responses.retrieve(final.id).output_text == "one two three "


def test_streaming_a_tool_call(http_server: ServerThread) -> None:
    events = list(_client(http_server).responses.create(model="default", input="the weather please", tools=[WEATHER],
                                                        stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done, final = events[2].item, events[-3], events[-1].response
    assert added.type == "function_call" and added.name == "get_weather" and added.status == "in_progress"
    assert json.loads(done.arguments) == {"city": "Paris"} and done.item_id == added.id
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta").strip() == \
        done.arguments
    assert [(o.type, o.call_id, o.arguments) for o in final.output] == [("function_call", added.call_id, done.arguments)]


def test_an_error_mid_stream_is_an_error_event_then_response_failed(http_server: ServerThread) -> None:
    client = _client(http_server)
    events = list(client.responses.create(model="default", input="boom now", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2].code == "internal" and "RuntimeError" in events[2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "internal"
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(failed.id)


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "json_schema", "name": "person", "schema": PERSON, "strict": True},
     ResponseFormat(ResponseFormatKind.JSON_SCHEMA, PERSON, "person", True)),
    ({"type": "json_object"}, ResponseFormat(ResponseFormatKind.JSON_OBJECT)),
    ({"type": "text"}, ResponseFormat()),
])
def test_text_format_is_the_response_format(http_server: ServerThread, backend: RecordingBackend, fmt: dict,
                                            expected: ResponseFormat) -> None:
    r = _client(http_server).responses.create(model="default", input="give json", text={"format": fmt})
    assert backend.params[-1].response_format == expected
    assert r.text.format.type == fmt["type"]


def test_store_false_is_neither_retrievable_nor_continued(http_server: ServerThread) -> None:
    client = _client(http_server)
    r = client.responses.create(model="default", input="forget me", store=False)
    assert r.store is False and r.output_text == "forget me "
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="default", input="and then", previous_response_id=r.id)
    assert info.value.body == {"message": f"Response with id {r.id!r} not found.", "type": "invalid_request_error",
                               "param": "previous_response_id", "code": "not_found"}


def test_get_and_delete(http_server: ServerThread) -> None:
    client = _client(http_server)
    r = client.responses.create(model="default", input="keep me", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_another_key_cannot_read_delete_or_continue_a_response(tmp_path: Path) -> None:
    alice, bob = "alice-secret-0123456789", "bob-secret-0123456789ab"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"name": "alice", "key_sha256": hashlib.sha256(alice.encode()).hexdigest()},
                                {"name": "bob", "key": bob}]))
    st = ServerThread(settings(api_keys_file=keys, http_port=0), lambda _: RecordingBackend())
    try:
        a, b = _client(st, alice), _client(st, bob)
        with pytest.raises(openai.AuthenticationError):
            _client(st, "wrong").responses.create(model="default", input="hello")
        r = a.responses.create(model="default", input="alice private words")
        for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                        lambda: b.responses.create(model="default", input="tell me", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError) as info:
                attempt()
            assert "not found" in info.value.body["message"]
        assert info.value.body["param"] == "previous_response_id"
        # nor does a cache salt of alice's own: it is another tenant
        with pytest.raises(openai.NotFoundError):
            a.responses.create(model="default", input="x", previous_response_id=r.id, extra_body={"cache_salt": "s"})
        assert a.responses.retrieve(r.id).output_text == "alice private words "  # still alice's
        assert a.responses.create(model="default", input="more", previous_response_id=r.id).output_text == "more "
    finally:
        st.stop()


@pytest.mark.parametrize(("kwargs", "param", "needle"), [
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "item_reference", "id": "x"}]}, "input[1].type",
     "item_reference"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call_output", "output": "x"}]},
     "input[1].call_id", "string"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                     "arguments": 3}]}, "input[1].arguments", "string"),
    ({"input": [{"role": "assistant", "content": "hi"}]}, "input", "user message"),
    ({"input": []}, "input", "at least one"),
    ({"input": 5}, "input", "string or a list"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", "web_search_preview"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", "name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"temperature": -1}, "temperature", "[0, 10]"),
    ({"max_output_tokens": 0}, "max_output_tokens", "got 0"),
    ({"extra_body": {"top_k": 99}}, "top_k", "[1, 32]"),
    ({"extra_body": {"conversation": "conv_1"}}, "conversation", "previous_response_id"),
    ({"previous_response_id": 7}, "previous_response_id", "7"),
])
def test_bad_requests_are_400_naming_the_field(http_server: ServerThread, kwargs: dict, param: str,
                                               needle: str) -> None:
    request = {"model": "default", "input": "q", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        _client(http_server).responses.create(**request)
    body = info.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and needle in body["message"], body


def test_unknown_collection_is_404(http_server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _client(http_server).responses.create(model="nope", input="q")
    assert info.value.body["code"] == "model_not_found"


def test_the_store_is_bounded_and_keeps_tenants_apart() -> None:
    store = ResponseStore(max_entries=2, max_entry_bytes=200)
    item = ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},)
    for i in range(3):
        assert store.put(f"r{i}", "alice", item, {"id": f"r{i}"})
    assert len(store) == 2 and store.get("r0", "alice") is None and store.get("r1", "alice") is not None
    assert store.get("r1", "bob") is None and not store.delete("r1", "bob") and store.get("r1", "alice")
    assert not store.put("big", "alice", item, {"id": "big", "pad": "x" * 300})
    store.get("r1", "alice")  # used: r2 goes first
    store.put("r3", "alice", item, {"id": "r3"})
    assert store.get("r2", "alice") is None and store.get("r1", "alice") is not None


def test_stored_responses_survive_a_restart_on_the_same_responses_dir(tmp_path: Path) -> None:
    """--responses-dir: a response stored before the server restarts is found after it (GET),
    continued by previous_response_id, and DELETE's forgetting survives the next restart too."""
    responses = tmp_path / "responses"
    before = ServerThread(settings(http_port=0, responses_dir=responses), lambda _: RecordingBackend())
    try:
        first = _client(before).responses.create(model="default", input="who wrote it")
        unstored = _client(before).responses.create(model="default", input="forget me", store=False)
    finally:
        before.stop()
    assert sorted(p.name for p in responses.iterdir()) == [f"{first.id}.json"]

    backend = RecordingBackend()
    after = ServerThread(settings(http_port=0, responses_dir=responses), lambda _: backend)
    try:
        client = _client(after)
        assert client.responses.retrieve(first.id).output_text == "who wrote it "
        second = client.responses.create(model="default", input="alpha beta", previous_response_id=first.id)
        assert second.output_text == "alpha beta " and second.previous_response_id == first.id
        assert backend.params[-1].history == (ChatTurn(ChatRole.USER, "who wrote it"),
                                              ChatTurn(ChatRole.ASSISTANT, "who wrote it "))
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        client.responses.delete(first.id)
    finally:
        after.stop()

    again = ServerThread(settings(http_port=0, responses_dir=responses), lambda _: RecordingBackend())
    try:
        with pytest.raises(openai.NotFoundError):
            _client(again).responses.retrieve(first.id)
        assert _client(again).responses.retrieve(second.id).output_text == "alpha beta "
    finally:
        again.stop()


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(http_server: ServerThread,
                                                              backend: RecordingBackend) -> None:
    if importlib.util.find_spec("agents") is None:
        pytest.skip("openai-agents is not installed (pip install openai-agents): the Agents SDK test needs it")
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no traces sent anywhere
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    async def run() -> tuple[str, str]:  # one event loop for the async client
        client = openai.AsyncOpenAI(base_url=_url(http_server), api_key="none", max_retries=0)
        agent = Agent(name="weather", model=OpenAIResponsesModel(model="default", openai_client=client),
                      tools=[get_weather])
        first = await Runner.run(agent, "what is the weather in Paris")
        assert asked == ["Paris"]  # the model called the tool; the SDK ran it and sent its output back
        turns = backend.params[-1].agent_turns
        assert turns[-1] == ChatTurn(ChatRole.TOOL, "sunny in Paris", tool_call_id=turns[0].tool_calls[0].id)
        # streamed, continuing the stored conversation
        second = Runner.run_streamed(agent, "and tomorrow", previous_response_id=first.last_response_id)
        async for _ in second.stream_events():
            pass
        return first.final_output, second.final_output

    first, second = asyncio.run(run())
    assert first.strip() == "what is the weather in Paris" and second.strip() == "and tomorrow"
    history = backend.params[-1].history
    assert history[0] == ChatTurn(ChatRole.USER, "what is the weather in Paris") and len(history) == 4
    assert history[-1] == ChatTurn(ChatRole.ASSISTANT, "what is the weather in Paris ")


def test_a_stored_response_is_read_under_its_keys_collections_now(tmp_path: Path) -> None:
    """Issue 71: GET and previous_response_id check the key's collections when they read, not
    when the response was stored: a key that lost a collection (its key file changed, the server
    restarted over the same --responses-dir) can no longer read what it stored there."""
    alice = "alice-secret-0123456789"
    keys, responses = tmp_path / "keys.json", tmp_path / "responses"
    keys.write_text(json.dumps([{"name": "alice", "key": alice, "collections": ["default"]}]))
    before = ServerThread(settings(api_keys_file=keys, http_port=0, responses_dir=responses),
                          lambda _: RecordingBackend())
    try:
        stored = _client(before, alice).responses.create(model="default", input="alice private words")
    finally:
        before.stop()
    keys.write_text(json.dumps([{"name": "alice", "key": alice, "collections": ["other"]}]))
    after = ServerThread(settings(api_keys_file=keys, http_port=0, responses_dir=responses),
                         lambda _: RecordingBackend())
    try:
        for attempt in (lambda: _client(after, alice).responses.retrieve(stored.id),
                        lambda: _client(after, alice).responses.create(model="other", input="go on",
                                                                       previous_response_id=stored.id)):
            with pytest.raises(openai.PermissionDeniedError):
                attempt()
    finally:
        after.stop()
