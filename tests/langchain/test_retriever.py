"""RagKVRetriever against a real gRPC server on loopback (fake backend)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from langchain_core.documents import Document

from ragkv.langchain import RagKVRetriever, RagKVServerError
from tests.server.fakes import ServerThread


def test_invoke_returns_documents_with_metadata(fake_server: ServerThread) -> None:
    docs = RagKVRetriever(target=fake_server.addr, top_k=3).invoke("anything")
    assert [d.id for d in docs] == ["doc0#0", "doc1#0", "doc2#0"]
    assert all(isinstance(d, Document) for d in docs)
    assert docs[0].page_content.startswith("chunk number 0 lorem ipsum")
    assert docs[1].metadata == {"source": "doc1.txt", "chunk_id": "doc1#0", "score": pytest.approx(0.9),
                                "collection": "default"}


def test_top_k_per_call_and_snippets(fake_server: ServerThread) -> None:
    retriever = RagKVRetriever(target=fake_server.addr, top_k=2, snippet_chars=6)
    assert [len(retriever.invoke("q", top_k=k)) for k in (1, 4)] == [1, 4]
    assert [d.page_content for d in retriever.invoke("q")] == ["chunk ", "chunk "]
    with pytest.raises(ValueError, match="top_k"):
        retriever.invoke("q", top_k=0)


def test_ainvoke(fake_server: ServerThread) -> None:
    retriever = RagKVRetriever(target=fake_server.addr, top_k=2)

    async def go() -> list[list[Document]]:
        results = await asyncio.gather(retriever.ainvoke("a"), retriever.ainvoke("b", top_k=5))
        await retriever.aclose()
        return results

    two, five = asyncio.run(go())
    assert [d.id for d in two] == ["doc0#0", "doc1#0"] and len(five) == 5


def test_errors(fake_server: ServerThread) -> None:
    retriever = RagKVRetriever(target=fake_server.addr, collection="nope", max_retries=0)
    with pytest.raises(RagKVServerError, match="NOT_FOUND.*nope") as err:
        retriever.invoke("q")
    assert err.value.code is grpc.StatusCode.NOT_FOUND and err.value.method == "Retrieve"
    with pytest.raises(RagKVServerError) as aerr:
        asyncio.run(retriever.ainvoke("q"))
    assert aerr.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(RagKVServerError, match="INVALID_ARGUMENT"):
        RagKVRetriever(target=fake_server.addr).invoke("q", top_k=33)
