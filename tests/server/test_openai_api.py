"""The OpenAI-compatible HTTP API, driven by clients we did not write: the official `openai`
package (sync, async, streaming) and LangChain's ChatOpenAI inside a LangGraph graph, against a
live server on loopback over the fake backend."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

from ragkv.client import RagClient
from ragkv.server.backend import Prepared
from ragkv.server.query import Query
from ragkv.server.status import InvalidArgumentError
from ragkv.types import ChatRole, ChatTurn, Mode, SearchMode
from tests.server.fakes import FakeBackend, ServerThread, settings

SYSTEM = "You answer from the context."
TOKEN = "s3cret"


class ChatBackend(FakeBackend):
    """The fake with an index system prompt: a different system message is refused, as the Pipeline does."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.params: list[Query] = []

    def prepare(self, params: Query, hits: object = None) -> Prepared:
        if params.system_prompt is not None and params.system_prompt.strip() != SYSTEM:
            raise InvalidArgumentError(
                "system_prompt", f"the request's system message {params.system_prompt!r} differs from the system "
                                 f"prompt collection {params.collection!r} was indexed with: {SYSTEM!r}")
        self.params.append(params)
        return super().prepare(params, hits)


@pytest.fixture
def chat_backend() -> ChatBackend:
    return ChatBackend()


@pytest.fixture
def http_server(chat_backend: ChatBackend):
    st = ServerThread(settings(http_port=0), lambda _: chat_backend)
    assert st.server.http_port
    yield st
    st.stop()


def _client(st: ServerThread, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=10, **kw)


def test_sync_non_streaming_with_sources_usage_and_options(http_server: ServerThread,
                                                           chat_backend: ChatBackend) -> None:
    client = _client(http_server)
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "who wrote it"},
                  {"role": "assistant", "content": "Nobody knows."},
                  {"role": "user", "content": "alpha beta gamma"}],
        max_tokens=2, seed=7, temperature=0.5, top_p=0.9, stop=["zzz"],
        extra_body={"mode": "blend", "top_k": 3, "recompute_ratio": 0.3, "search_mode": "lexical"},
    )
    assert reply.choices[0].message.content == "alpha beta "
    assert reply.choices[0].finish_reason == "length"
    assert reply.model == "default" and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == 10 + 12 * 3 and reply.usage.completion_tokens == 2
    assert reply.usage.total_tokens == 48
    assert reply.usage.prompt_tokens_details.cached_tokens == 36
    extra = reply.model_extra["ragkv"]
    assert [s["chunk_id"] for s in extra["sources"]] == ["doc0#0", "doc1#0", "doc2#0"]
    assert [s["kv_tier"] for s in extra["sources"]] == ["cpu", "disk", "computed"]
    assert extra["sources"][0]["score"] == pytest.approx(1.0)
    assert extra["sources"][0]["metadata"] == {"source": "doc0.txt"}
    assert extra["mode"] == "blend" and extra["recompute_fraction"] == pytest.approx(0.3)
    assert 0 < extra["ttft_seconds"] <= extra["total_seconds"]
    assert {"retrieve", "queue", "decode"} <= set(extra["phase_seconds"])
    p = chat_backend.params[-1]
    sampling = p.sampling
    assert (p.mode, p.top_k, p.search_mode, sampling.seed, sampling.stop) == (Mode.BLEND, 3, SearchMode.LEXICAL, 7,
                                                                              ("zzz",))
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert sampling.max_new_tokens == 2
    assert p.system_prompt == SYSTEM and p.question == "alpha beta gamma"
    assert p.history == (ChatTurn(ChatRole.USER, "who wrote it"), ChatTurn(ChatRole.ASSISTANT, "Nobody knows."))


def test_sync_streaming_final_chunk_carries_sources(http_server: ServerThread) -> None:
    client = _client(http_server)
    stream = client.chat.completions.create(model="default", stream=True,
                                            messages=[{"role": "user", "content": "one two three"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three "
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.usage.prompt_tokens_details.cached_tokens == 48
    assert [s["kv_tier"] for s in last.model_extra["ragkv"]["sources"]] == ["cpu", "disk", "computed", "gpu"]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streaming_include_usage_puts_usage_in_a_last_chunk_without_choices(http_server: ServerThread) -> None:
    stream = _client(http_server).chat.completions.create(
        model="default", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "a b"}])
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].usage is None
    assert chunks[-2].model_extra["ragkv"]["sources"]


def test_async_client_concurrent_and_streaming(http_server: ServerThread) -> None:
    async def main() -> tuple[list[str], str]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_server.server.http_port}/v1",
                                    api_key="none", max_retries=0, timeout=10)
        replies = await asyncio.gather(*(
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": f"async {i}"}])
            for i in range(6)))
        stream = await client.chat.completions.create(
            model="default", stream=True, messages=[{"role": "user", "content": [{"type": "text", "text": "x y"}]}])
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return [r.choices[0].message.content for r in replies], "".join(pieces)

    answers, streamed = asyncio.run(main())
    assert answers == [f"async {i} " for i in range(6)]
    assert streamed == "x y "


def test_models_and_health(http_server: ServerThread) -> None:
    client = _client(http_server)
    assert [m.id for m in client.models.list()] == ["default", "mismatch"]
    assert client.models.retrieve("default").model_extra["ragkv"]["num_chunks"] == 8
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    url = f"http://127.0.0.1:{http_server.server.http_port}/health"
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "serving"}


@pytest.mark.parametrize(
    ("kwargs", "exc", "param", "needle"),
    [
        ({"model": "nope"}, openai.NotFoundError, None, "'nope' is not served"),
        ({"model": "mismatch"}, openai.BadRequestError, None, "other-model-fp"),
        ({"extra_body": {"mode": "sideways"}}, openai.BadRequestError, "mode", "sideways"),
        ({"extra_body": {"top_k": 99}}, openai.BadRequestError, "top_k", "[1, 32]"),
        ({"extra_body": {"recompute_ratio": 2}}, openai.BadRequestError, "recompute_ratio", "[0, 1]"),
        ({"temperature": -1}, openai.BadRequestError, "sampling.temperature", "[0, 10]"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_new_tokens", "got 0"),
        ({"n": 2}, openai.BadRequestError, "n", "n=1"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, openai.BadRequestError, "messages", "user message"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "hi"}]},
         openai.BadRequestError, "messages", "last message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, openai.BadRequestError, "messages[0].tool_call_id", "tool"),
        ({"messages": [{"role": "robot", "content": "x"}]}, openai.BadRequestError, "messages[0].role", "robot"),
        ({"messages": [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": "q"}]},
         openai.BadRequestError, "system_prompt", "Be a pirate."),
    ],
)
def test_errors_map_to_openai_statuses(http_server: ServerThread, kwargs: dict, exc: type, param: str | None,
                                       needle: str) -> None:
    request = {"model": "default", "messages": [{"role": "user", "content": "q"}], **kwargs}
    with pytest.raises(exc) as info:
        _client(http_server).chat.completions.create(**request)
    body = info.value.body
    assert body["param"] == param and needle in body["message"], body
    if param == "system_prompt":  # the error names both prompts
        assert SYSTEM in body["message"]


def test_system_prompt_mismatch_is_invalid_argument_on_grpc_too(http_server: ServerThread) -> None:
    with RagClient(http_server.addr, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.query("q", system_prompt="Be a pirate.").result()
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Be a pirate." in info.value.details() and SYSTEM in info.value.details()


def test_grpc_history_reaches_the_backend(http_server: ServerThread, chat_backend: ChatBackend) -> None:
    history = [ChatTurn(ChatRole.USER, "earlier"), ChatTurn(ChatRole.ASSISTANT, "reply")]
    with RagClient(http_server.addr, timeout=10) as client:
        assert client.query("now what", history=history, system_prompt=SYSTEM).result().text == "now what "
    assert chat_backend.params[-1].history == tuple(history)
    assert chat_backend.params[-1].system_prompt == SYSTEM


def test_bad_json_is_400_with_openai_error_body(http_server: ServerThread) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{http_server.server.http_port}/v1/chat/completions",
                                     data=b"{nope", headers={"content-type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "body" and "not valid JSON" in err["message"]


def test_queue_full_is_429() -> None:
    backend = ChatBackend(token_delay=0.05, n_pieces=40)
    st = ServerThread(settings(http_port=0, max_queue=1), lambda _: backend)
    try:
        async def main() -> list[object]:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none",
                                        max_retries=0, timeout=20)
            results = await asyncio.gather(*(
                client.chat.completions.create(model="default", messages=[{"role": "user", "content": f"q{i}"}])
                for i in range(3)), return_exceptions=True)
            await client.close()
            return results

        results = asyncio.run(main())
    finally:
        st.stop()
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(limited) == 2 and "queue is full" in limited[0].body["message"], results
    assert sum(1 for r in results if not isinstance(r, Exception)) == 1


def test_bearer_auth_same_token_as_grpc(monkeypatch: pytest.MonkeyPatch, chat_backend: ChatBackend) -> None:
    monkeypatch.setenv("RAGKV_AUTH_TOKEN", TOKEN)
    st = ServerThread(settings(http_port=0), lambda _: chat_backend)
    try:
        msgs = [{"role": "user", "content": "hello there"}]
        with pytest.raises(openai.AuthenticationError) as info:
            _client(st, api_key="wrong").chat.completions.create(model="default", messages=msgs)
        assert info.value.body["message"] == "invalid API key"
        with pytest.raises(openai.AuthenticationError):
            _client(st, api_key="wrong").models.list()
        reply = _client(st, api_key=TOKEN).chat.completions.create(model="default", messages=msgs)
        assert reply.choices[0].message.content == "hello there "
        # health stays open to probes
        with urllib.request.urlopen(f"http://127.0.0.1:{st.server.http_port}/health", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(f"http://127.0.0.1:{st.server.http_port}/v1/models", timeout=5)
        assert http_info.value.code == 401
        # every other path too (the key is checked before routing): no probing for routes or stored responses
        for path in ("/v1/responses/resp_x", "/v1/no-such-route", "/health/../v1/models"):
            with pytest.raises(urllib.error.HTTPError) as http_info:
                urllib.request.urlopen(f"http://127.0.0.1:{st.server.http_port}{path}", timeout=5)
            assert http_info.value.code == 401, path
            assert json.loads(http_info.value.read())["error"]["type"] == "authentication_error"
    finally:
        st.stop()


def test_langchain_chat_openai_in_a_langgraph_graph(http_server: ServerThread, chat_backend: ChatBackend) -> None:
    llm = ChatOpenAI(model="default", base_url=f"http://127.0.0.1:{http_server.server.http_port}/v1",
                     api_key="none", max_retries=0, timeout=10, streaming=True,
                     extra_body={"mode": "reuse", "top_k": 2})

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    app = graph.compile()

    async def main() -> tuple[dict, list[str]]:
        state = {"messages": [SystemMessage(SYSTEM), HumanMessage("first question"),
                              AIMessage("first answer"), HumanMessage("red green blue")]}
        out = await app.ainvoke(state)
        pieces = [chunk.content async for chunk, _meta in app.astream(state, stream_mode="messages") if chunk.content]
        return out, pieces

    out, pieces = asyncio.run(main())
    answer = out["messages"][-1]
    assert isinstance(answer, AIMessage) and answer.content == "red green blue "
    assert pieces == ["red ", "green ", "blue "]  # tokens stream through the graph
    p = chat_backend.params[-1]
    assert p.mode is Mode.REUSE and p.top_k == 2 and p.system_prompt == SYSTEM
    assert p.history == (ChatTurn(ChatRole.USER, "first question"), ChatTurn(ChatRole.ASSISTANT, "first answer"))


def test_a_client_that_leaves_mid_stream_cancels_the_answer() -> None:
    backend = ChatBackend(token_delay=0.05, n_pieces=200)
    st = ServerThread(settings(http_port=0), lambda _: backend)
    try:
        stream = _client(st).chat.completions.create(model="default", stream=True,
                                                     messages=[{"role": "user", "content": "long one"}])
        pieces = 0
        for chunk in stream:
            pieces += bool(chunk.choices and chunk.choices[0].delta.content)
            if pieces == 3:
                break
        stream.close()
        deadline = time.monotonic() + 10
        while "long one" not in backend.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        st.stop()
    assert backend.cancelled == ["long one"] and backend.finished == []


def test_http_port_setting_and_flag() -> None:
    from ragkv.server.settings import load_settings

    assert load_settings({"http_port": "8000"}, env={}).http_port == 8000
    assert load_settings({}, env={"RAGKV_HTTP_PORT": "off"}).http_port is None
    assert load_settings({}, env={}).http_port is None  # off unless asked for
    with pytest.raises(ValueError, match="http_port"):
        load_settings({"http_port": "70000"}, env={})
