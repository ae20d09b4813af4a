"""Fixtures: ragkv servers on 127.0.0.1 for the LangChain adapters.

`fake_server` runs the real gRPC service over tests.server's FakeBackend (answers are
the question's words, one piece each; "boom" fails mid-stream). `real_server` runs the
real pipeline over the tiny random Llama index that tests.server builds.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("langchain_core")

from tests.server.fakes import FakeBackend, ServerThread, settings
from tests.server.test_pipeline import tiny_index  # noqa: F401  (session fixture, reused)

TOKEN = "lc-test-token"


@pytest.fixture(scope="module")
def fake_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def fake_server(fake_backend: FakeBackend):
    st = ServerThread(settings(max_queue=32), lambda _: fake_backend)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def slow_backend() -> FakeBackend:
    return FakeBackend(token_delay=0.05, n_pieces=200)


@pytest.fixture(scope="module")
def slow_server(slow_backend: FakeBackend):
    st = ServerThread(settings(), lambda _: slow_backend)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    st = ServerThread(settings(auth_token_file=token_file), lambda _: FakeBackend())
    yield st
    st.stop()


@pytest.fixture(scope="module")
def real_server(tiny_index):  # noqa: F811
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.settings import CollectionSpec

    st = ServerThread(settings(indexes=(CollectionSpec("default", tiny_index),)), build_pipeline)
    yield st
    st.stop()
