"""A small LangGraph agent over a ragkv server: search with a retriever tool, then stream the answer.

    pip install 'ragkv[langgraph]'
    ragkv serve --index ./index          # in another terminal
    python examples/langgraph_agent.py "What is the secret number?" --addr localhost:50051

The graph:

    START -> plan -> tools -> answer -> END
                          \\-> no_answer -> END

- plan: asks the `search_docs` tool (our RagKVChatModel does no tool calling, so this
  node writes the tool call itself: the user's last question, as is).
- tools: a LangGraph ToolNode running `create_retriever_tool(RagKVRetriever)`; its
  Documents come back as the ToolMessage's artifact.
- route: no chunk at or above `min_score` -> no_answer (no generation spent); else answer.
- answer: RagKVChatModel. The server retrieves again and answers from the chunks'
  cached KVs (the tool's text is not pasted into the prompt: that would defeat KV
  reuse). With `stream_mode="messages"` its tokens stream out of the graph as they
  are decoded; `response_metadata` names the chunks the answer used.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Sequence
from typing import TextIO

from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import create_retriever_tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from ragkv.langchain import RagKVChatModel, RagKVRetriever

TOOL_NAME = "search_docs"
NO_ANSWER = "I found nothing relevant in the collection."


def build_agent(llm: RagKVChatModel, retriever: RagKVRetriever, min_score: float | None = None):
    """The compiled graph; run it with {"messages": [HumanMessage(question)]}.

    Args:
        llm: Answers the question (one ragkv Query).
        retriever: Backs the search tool (one ragkv Retrieve).
        min_score: Answer only when some chunk scores at least this; None = any chunk.
    """
    search = create_retriever_tool(
        retriever, TOOL_NAME, "Search the ragkv collection for passages about the question.",
        response_format="content_and_artifact",
    )

    def plan(state: MessagesState) -> dict:
        question = next(m for m in reversed(state["messages"]) if isinstance(m, HumanMessage)).text
        call = {"name": TOOL_NAME, "args": {"query": question}, "id": f"call_{uuid.uuid4().hex[:12]}"}
        return {"messages": [AIMessage(content="", tool_calls=[call])]}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        docs: Sequence[Document] = last.artifact if isinstance(last, ToolMessage) and last.artifact else ()
        found = [d for d in docs if min_score is None or d.metadata["score"] >= min_score]
        return "answer" if found else "no_answer"

    # The chat model asks the last human message; tool messages are not sent.
    # Sync and async bodies, so both graph.stream() and graph.astream() work.
    def answer(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    async def aanswer(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def no_answer(state: MessagesState) -> dict:
        return {"messages": [AIMessage(content=NO_ANSWER)]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_node("tools", ToolNode([search]))
    graph.add_node("answer", RunnableLambda(answer, afunc=aanswer))
    graph.add_node("no_answer", no_answer)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "tools")
    graph.add_conditional_edges("tools", route, ["answer", "no_answer"])
    graph.add_edge("answer", END)
    graph.add_edge("no_answer", END)
    return graph.compile()


async def run(question: str, agent, out: TextIO | None = None) -> AIMessage:
    """Stream one question through the agent: tokens to `out` (stdout) as they come, then the sources."""
    out = out or sys.stdout
    final: AIMessageChunk | None = None
    async for message, meta in agent.astream({"messages": [HumanMessage(question)]}, stream_mode="messages"):
        if meta["langgraph_node"] == "answer" and isinstance(message, AIMessageChunk):
            out.write(message.text)
            out.flush()
            final = message if final is None else final + message
    if final is None:  # the no_answer branch: nothing streamed from the model
        out.write(NO_ANSWER + "\n")
        return AIMessage(content=NO_ANSWER)
    meta = final.response_metadata
    out.write("\n")
    for cid, score in zip(meta.get("chunk_ids", []), meta.get("scores", [])):
        out.write(f"  source {cid} (score {score:.3f})\n")
    out.write(f"  mode={meta.get('mode')} ttft={meta.get('ttft_seconds', 0.0) * 1000:.0f}ms\n")
    return AIMessage(content=final.content, response_metadata=meta, usage_metadata=final.usage_metadata)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("--addr", default=os.environ.get("RAGKV_ADDR", "localhost:50051"), help="server host:port")
    p.add_argument("--collection", default=None)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--mode", default=None, help="full, prefix, reuse, blend or focus (default: the server's, blend)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-score", type=float, default=None, help="answer only above this retrieval score")
    args = p.parse_args(argv)

    llm = RagKVChatModel(target=args.addr, collection=args.collection, top_k=args.top_k, mode=args.mode,
                         max_tokens=args.max_tokens)
    retriever = RagKVRetriever(target=args.addr, collection=args.collection, top_k=args.top_k, snippet_chars=500)

    async def ask() -> None:
        try:
            await run(args.question, build_agent(llm, retriever, args.min_score))
        finally:
            await llm.aclose()
            await retriever.aclose()

    asyncio.run(ask())
    return 0


if __name__ == "__main__":
    sys.exit(main())
