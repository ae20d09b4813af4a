"""Fixtures for indexer tests: the tiny Llama loaded once, the shipped embedder loaded once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_lm(tiny_llama_dir):
    from engine import load_model

    return load_model(str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedder():
    from retriever.embedder import Embedder

    return Embedder.load()


@pytest.fixture()
def corpus(tmp_path):
    from tests.indexer.helpers import write_corpus

    return write_corpus(tmp_path / "corpus")


@pytest.fixture()
def job_config(tmp_path, corpus, tiny_llama_dir):
    from indexer.chunking import ChunkingConfig
    from indexer.job import IndexJobConfig
    from tests.indexer.helpers import CHUNK_SIZE, OVERLAP

    return IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(tiny_llama_dir),
                          chunking=ChunkingConfig(CHUNK_SIZE, OVERLAP), progress=False, kv_batch=2)
