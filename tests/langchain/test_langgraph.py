"""The example LangGraph agent end to end on loopback servers, tokens via stream_mode="messages"."""

from __future__ import annotations

import asyncio
import importlib.util
import io
from pathlib import Path

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage

from ragkv.langchain import RagKVChatModel, RagKVRetriever, RagKVServerError
from tests.server.fakes import ServerThread

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_agent.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("langgraph_agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agent(example, addr: str, min_score: float | None = None, **llm_kwargs: object):
    llm = RagKVChatModel(target=addr, timeout=60, top_k=2, **llm_kwargs)
    return example.build_agent(llm, RagKVRetriever(target=addr, top_k=2), min_score)


def test_sync_stream_messages_mode_streams_tokens_from_the_answer_node(example, fake_server: ServerThread) -> None:
    agent = _agent(example, fake_server.addr)
    by_node: dict[str, list] = {}
    for message, meta in agent.stream({"messages": [HumanMessage("where is the fox today")]}, stream_mode="messages"):
        by_node.setdefault(meta["langgraph_node"], []).append(message)
    tokens = [m.content for m in by_node["answer"] if isinstance(m, AIMessageChunk) and m.content]
    assert tokens == ["where ", "is ", "the ", "fox ", "today "]
    tool_msgs = by_node["tools"]
    assert len(tool_msgs) == 1 and isinstance(tool_msgs[0], ToolMessage)
    assert [d.id for d in tool_msgs[0].artifact] == ["doc0#0", "doc1#0"]


def test_async_graph_state_holds_the_answer_with_sources(example, fake_server: ServerThread) -> None:
    agent = _agent(example, fake_server.addr)

    async def go() -> tuple[int, dict]:
        n = 0
        async for message, meta in agent.astream({"messages": [HumanMessage("red fox")]}, stream_mode="messages"):
            n += meta["langgraph_node"] == "answer" and bool(message.content)
        state = await agent.ainvoke({"messages": [HumanMessage("blue dog runs")]})
        return n, state

    n, state = asyncio.run(go())
    assert n == 2
    kinds = [m.type for m in state["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"]
    assert state["messages"][1].tool_calls[0]["args"] == {"query": "blue dog runs"}
    answer = state["messages"][-1]
    assert answer.content == "blue dog runs " and answer.response_metadata["chunk_ids"] == ["doc0#0", "doc1#0"]


def test_low_scores_route_to_no_answer_without_generating(example, fake_server: ServerThread, fake_backend) -> None:
    agent = _agent(example, fake_server.addr, min_score=1.5)  # the fake's best score is 1.0
    before = len(fake_backend.started)
    state = agent.invoke({"messages": [HumanMessage("unanswerable")]})
    assert state["messages"][-1].content == example.NO_ANSWER
    assert len(fake_backend.started) == before  # no Query was sent


def test_server_error_in_the_answer_node_surfaces(example, fake_server: ServerThread) -> None:
    agent = _agent(example, fake_server.addr, max_retries=0)
    with pytest.raises(RagKVServerError, match="INTERNAL"):
        agent.invoke({"messages": [HumanMessage("boom goes the engine")]})


def test_example_main_on_the_real_pipeline(example, real_server: ServerThread, capsys) -> None:
    """The example CLI against the real pipeline (tiny random Llama, the server's default mode)."""
    assert example.main(["What is the secret number?", "--addr", real_server.addr, "--top-k", "2",
                         "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "source " in out and "mode=blend" in out  # the server's default (docs/quality.md)


def test_real_pipeline_streams_several_token_chunks_through_langgraph(example, real_server: ServerThread) -> None:
    agent = _agent(example, real_server.addr, mode="blend", max_tokens=8)

    async def go() -> tuple[list[str], AIMessage]:
        pieces: list[str] = []
        async for message, meta in agent.astream({"messages": [HumanMessage("What is the secret number?")]},
                                                 stream_mode="messages"):
            if meta["langgraph_node"] == "answer" and message.content:
                pieces.append(message.content)
        out = io.StringIO()
        final = await example.run("Where did Alice meet Bob?", agent, out)
        return pieces, final

    pieces, final = asyncio.run(go())
    assert len(pieces) > 1
    meta = final.response_metadata
    assert meta["mode"] == "blend" and len(meta["chunk_ids"]) == 2
    assert {c["kv_tier"] for c in meta["chunks"]} <= {"cpu", "disk"}
    assert final.usage_metadata["input_token_details"]["cache_read"] > 0
