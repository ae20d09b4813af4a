"""`ragkv query` against a loopback server with a fake backend."""

from __future__ import annotations

import json

import pytest

from ragkv.cli.main import main
from tests.server.fakes import FakeBackend, ServerThread, settings


@pytest.fixture
def server():
    st = ServerThread(settings(), lambda _: FakeBackend())
    yield st
    st.stop()


def test_query_streams_answer_and_stats(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["query", "where is the fox", "--addr", server.addr, "--mode", "reuse", "--top-k", "2"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == "where is the fox \n"
    assert "[1] doc0#0" in err and "kv=cpu" in err and "mode=reuse" in err and "ttft=" in err


def test_query_json(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["query", "a b c", "--addr", server.addr, "--json", "--max-new-tokens", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["answer"] == "a b "
    assert doc["stats"]["finish_reason"] == "length" and doc["stats"]["mode"] == "blend"  # the server default
    assert [c["chunk_id"] for c in doc["chunks"]] == [f"doc{i}#0" for i in range(4)]
    # a backend that names no subset used every retrieved chunk
    assert doc["stats"]["used_chunk_ids"] == [f"doc{i}#0" for i in range(4)]
    assert doc["client_ttft_seconds"] > 0


def test_query_error_exit_code(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["query", "q", "--addr", server.addr, "--collection", "nope"])
    assert rc == 1
    assert "NOT_FOUND" in capsys.readouterr().err
