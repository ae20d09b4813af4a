"""RagKVChatModel against a real gRPC server on loopback (fake backend): sync, async, errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage

from ragkv.langchain import (
    RagKVChatModel,
    RagKVServerError,
    history_from_messages,
    question_from_messages,
    system_prompt_from_messages,
)
from ragkv.types import ChatRole, ChatTurn
from tests.langchain.conftest import TOKEN
from tests.server.fakes import FakeBackend, ServerThread


def _model(server: ServerThread, **kwargs: object) -> RagKVChatModel:
    return RagKVChatModel(target=server.addr, timeout=10, **kwargs)


def test_invoke_answers_with_chunks_stats_and_usage(fake_server: ServerThread) -> None:
    llm = _model(fake_server, top_k=3, mode="blend", recompute_ratio=0.25)
    msg = llm.invoke("one two three")
    assert isinstance(msg, AIMessage) and msg.content == "one two three "
    meta = msg.response_metadata
    assert meta["chunk_ids"] == ["doc0#0", "doc1#0", "doc2#0"]
    assert meta["scores"] == pytest.approx([1.0, 0.9, 0.8])
    assert [c["kv_tier"] for c in meta["chunks"]] == ["cpu", "disk", "computed"]
    assert meta["chunks"][0]["metadata"] == {"source": "doc0.txt"} and "text" not in meta["chunks"][0]
    assert meta["mode"] == "blend" and meta["recompute_fraction"] == pytest.approx(0.25)
    assert meta["used_chunk_ids"] == meta["chunk_ids"]  # blend computes over every retrieved chunk
    assert meta["finish_reason"] == "stop" and meta["model_name"] == "ragkv" and meta["collection"] == "default"
    assert 0 < meta["ttft_seconds"] <= meta["total_seconds"] and "decode" in meta["phase_seconds"]
    assert msg.usage_metadata == {
        "input_tokens": 46, "output_tokens": 3, "total_tokens": 49, "input_token_details": {"cache_read": 36},
    }


def test_stream_yields_one_chunk_per_token_then_a_last_chunk(fake_server: ServerThread) -> None:
    chunks = list(_model(fake_server, top_k=2).stream("alpha beta gamma delta"))
    assert [c.content for c in chunks] == ["alpha ", "beta ", "gamma ", "delta ", ""]
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert chunks[0].response_metadata["chunk_ids"] == ["doc0#0", "doc1#0"]  # sources arrive with the 1st token
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] == 4
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == "alpha beta gamma delta " and full.response_metadata["chunk_ids"] == ["doc0#0", "doc1#0"]


def test_parameters_map_to_the_query(fake_server: ServerThread) -> None:
    llm = _model(fake_server, top_k=5, mode="full", max_tokens=2, chunk_text_chars=1000)
    msg = llm.invoke("a b c d e")
    assert msg.content == "a b " and msg.response_metadata["finish_reason"] == "length"
    assert msg.response_metadata["mode"] == "full" and msg.response_metadata["recompute_fraction"] == 1.0
    assert len(msg.response_metadata["chunk_ids"]) == 5
    assert msg.response_metadata["chunks"][0]["text"].startswith("chunk number 0")
    # per-call overrides, through invoke and through bind
    msg = llm.invoke("a b c d e", top_k=1, max_tokens=4, mode="reuse")
    assert msg.content == "a b c d " and msg.response_metadata["chunk_ids"] == ["doc0#0"]
    assert msg.response_metadata["mode"] == "reuse"
    assert llm.bind(top_k=2).invoke("x").response_metadata["chunk_ids"] == ["doc0#0", "doc1#0"]


def test_last_human_message_is_the_question(fake_server: ServerThread, fake_backend: FakeBackend) -> None:
    conversation = [
        SystemMessage("be brief"),
        HumanMessage("first question"),
        AIMessage("first answer"),
        HumanMessage("second question"),
        ToolMessage("tool output", tool_call_id="t1"),
    ]
    assert _model(fake_server).invoke(conversation).content == "second question "
    with_history = _model(fake_server, history_messages=2).invoke(conversation)
    assert fake_backend.started[-1] == "second question"  # the question alone is what retrieval embeds
    assert with_history.content == "second question "


def test_history_and_system_prompt_reach_the_server(fake_server: ServerThread, fake_backend: FakeBackend,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    prepare = fake_backend.prepare
    monkeypatch.setattr(fake_backend, "prepare", lambda params, hits=None: seen.append(params) or prepare(params, hits))
    conversation = [SystemMessage("be brief"), HumanMessage("first question"), AIMessage("first answer"),
                    HumanMessage("second question")]
    _model(fake_server, history_messages=2).invoke(conversation)
    assert seen[-1].system_prompt == "be brief"
    assert seen[-1].history == (ChatTurn(ChatRole.USER, "first question"), ChatTurn(ChatRole.ASSISTANT, "first answer"))
    _model(fake_server).invoke([HumanMessage("alone")])
    assert seen[-1].system_prompt is None and seen[-1].history == ()


def test_question_from_messages_rules() -> None:
    msgs = [HumanMessage("q1"), AIMessage("a1"), HumanMessage([{"type": "text", "text": "q2"}])]
    assert question_from_messages(msgs) == "q2"
    assert history_from_messages(msgs, 1) == (ChatTurn(ChatRole.ASSISTANT, "a1"),)
    assert history_from_messages(msgs, 9) == (ChatTurn(ChatRole.USER, "q1"), ChatTurn(ChatRole.ASSISTANT, "a1"))
    assert history_from_messages(msgs, 0) == ()
    assert system_prompt_from_messages([SystemMessage("a"), SystemMessage("b"), *msgs]) == "a\n\nb"
    with pytest.raises(ValueError, match="human message"):
        question_from_messages([SystemMessage("s"), AIMessage("a")])
    with pytest.raises(ValueError, match="no text"):
        question_from_messages([HumanMessage("  ")])


def test_async_invoke_and_astream(fake_server: ServerThread) -> None:
    llm = _model(fake_server, top_k=2)

    async def go() -> tuple[AIMessage, list[AIMessageChunk], list[AIMessage]]:
        msg = await llm.ainvoke("red green blue")
        chunks = [c async for c in llm.astream("x y z w")]
        batch = await llm.abatch(["p q", "r s t"])
        await llm.aclose()
        return msg, chunks, batch

    msg, chunks, batch = asyncio.run(go())
    assert msg.content == "red green blue " and msg.response_metadata["chunk_ids"] == ["doc0#0", "doc1#0"]
    assert [c.content for c in chunks] == ["x ", "y ", "z ", "w ", ""]
    assert [m.content for m in batch] == ["p q ", "r s t "]
    # a second event loop gets its own channel (the first loop's is closed)
    assert asyncio.run(llm.ainvoke("again")).content == "again "


def test_astream_is_native_async(slow_server: ServerThread) -> None:
    """Tokens arrive while the loop stays free: another task ticks between them."""
    llm = _model(slow_server, max_tokens=6)

    async def go() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        n = 0
        async for chunk in llm.astream("go"):
            n += bool(chunk.content)
        task.cancel()
        await llm.aclose()
        return n, ticks

    n, ticks = asyncio.run(go())
    assert n == 6
    assert ticks >= 10  # 6 pieces x 50 ms: a blocking implementation would starve the ticker


def test_breaking_out_of_a_stream_cancels_the_query(slow_server: ServerThread, slow_backend: FakeBackend) -> None:
    llm = _model(slow_server)
    question = "cancel me (sync)"
    for i, _ in enumerate(llm.stream(question)):
        if i == 1:
            break
    deadline = time.monotonic() + 5
    while question not in slow_backend.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert question in slow_backend.cancelled and question not in slow_backend.finished


@pytest.mark.parametrize(
    ("kwargs", "question", "code", "text"),
    [
        ({"collection": "nope"}, "q", grpc.StatusCode.NOT_FOUND, "nope"),
        ({"collection": "mismatch"}, "q", grpc.StatusCode.FAILED_PRECONDITION, "other-model-fp"),
        ({"top_k": 33}, "q", grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        ({}, "boom now", grpc.StatusCode.INTERNAL, "internal error"),
    ],
)
def test_server_errors_are_ragkv_server_errors(
    fake_server: ServerThread, kwargs: dict, question: str, code: grpc.StatusCode, text: str
) -> None:
    llm = _model(fake_server, max_retries=0, **kwargs)
    with pytest.raises(RagKVServerError, match=text) as err:
        llm.invoke(question)
    assert err.value.code is code and err.value.method == "Query" and code.name in str(err.value)
    assert isinstance(err.value.__cause__, grpc.RpcError)
    with pytest.raises(RagKVServerError) as aerr:
        asyncio.run(llm.ainvoke(question))
    assert aerr.value.code is code


def test_unreachable_server_is_unavailable() -> None:
    llm = RagKVChatModel(target="127.0.0.1:1", timeout=5, max_retries=1)
    started = time.monotonic()
    with pytest.raises(RagKVServerError) as err:
        llm.invoke("anyone?")
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "127.0.0.1:1" in str(err.value)
    assert time.monotonic() - started < 5


def test_caller_mistakes_fail_before_the_server() -> None:
    llm = RagKVChatModel(target="127.0.0.1:1")
    with pytest.raises(ValueError, match="mode must be one of"):
        llm.invoke("q", mode="fastest")
    with pytest.raises(TypeError, match="topk"):
        llm.invoke("q", topk=3)
    with pytest.raises(ValueError, match="human message"):
        llm.invoke([SystemMessage("only a system message")])
    with pytest.raises(ValueError):
        RagKVChatModel(recompute_ratio=1.5)


def test_bearer_token(auth_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RagKVServerError) as err:
        _model(auth_server).invoke("hello")
    assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert _model(auth_server, api_key=TOKEN).invoke("hello there").content == "hello there "
    monkeypatch.setenv("RAGKV_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("RAGKV_ADDR", auth_server.addr)
    assert RagKVChatModel().invoke("from env").content == "from env "


def test_import_ragkv_does_not_import_langchain_or_torch() -> None:
    code = "import sys, ragkv; ragkv.RagClient; print(sorted(m for m in ('langchain_core', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
