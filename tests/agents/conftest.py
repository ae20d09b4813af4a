"""Fixtures: a ragkv server answering with the shipped SmolLM2-135M, gRPC and HTTP.

The agent tests hold the interface to the real model: what constrained decoding
guarantees (a call parses against its tool's schema, JSON against its response
format, a citation names a retrieved chunk) must hold whatever a weak model would
write unconstrained.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import CORPUS, tiny_index  # noqa: F401  (session fixture, reused)

AGENT_CORPUS = {
    **CORPUS,
    "weather.txt": "Weather reports for cities come from the get_weather tool, not from documents.",
    "magic.txt": "The magic function is a tool; nobody knows its value without calling it.",
}


@pytest.fixture(scope="session")
def smol_index(tmp_path_factory: pytest.TempPathFactory, smollm2) -> Path:
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    root = tmp_path_factory.mktemp("smol-index")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in AGENT_CORPUS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", chunking=ChunkingConfig(size=64, overlap=0),
                             progress=False), lm=smollm2)
    return root / "index"


@pytest.fixture(scope="session")
def smol_server(smol_index: Path, smollm2):
    """SmolLM2 behind gRPC and the OpenAI HTTP API (mode blend, top_k 2 by default)."""
    from ragkv.retriever import Retriever
    from ragkv.server.assembly import assemble_pipeline
    from ragkv.server.settings import CollectionSpec

    retriever = Retriever.open(smol_index)

    def factory(s):  # share the session's loaded model
        return assemble_pipeline(smollm2, {"default": (smol_index, retriever)}, s)

    st = ServerThread(settings(indexes=(CollectionSpec("default", smol_index),), http_port=0), factory)
    yield st
    st.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_index: Path):  # noqa: F811
    """The tiny random Llama behind both APIs: the harshest writer a grammar can hold."""
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.settings import CollectionSpec

    st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),), http_port=0), build_pipeline)
    yield st
    st.stop()
