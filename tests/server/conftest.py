"""Fixtures: a fake-backend server on 127.0.0.1 per test."""

from __future__ import annotations

import os

import pytest

from tests.server.fakes import FakeBackend, ServerThread, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def server(backend: FakeBackend):
    st = ServerThread(settings(), lambda _: backend)
    yield st
    st.stop()


@pytest.fixture
def slow_backend() -> FakeBackend:
    return FakeBackend(token_delay=0.05, n_pieces=40)


@pytest.fixture
def slow_server(slow_backend: FakeBackend):
    st = ServerThread(settings(max_queue=3), lambda _: slow_backend)
    yield st
    st.stop()
