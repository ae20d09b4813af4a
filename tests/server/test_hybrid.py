"""A hybrid model (recurrent Gated DeltaNet layers between attention layers) end to end: the
index skips chunk KV it could never reuse, the server answers in FULL mode by default and
refuses a chunk-KV mode naming the one it serves, and an agent's next call resumes from the
KV tree (its recurrent state held where the last prompt ended) with the answer a server
without the tree gives."""

from __future__ import annotations

import grpc
import pytest

from ragkv.client import RagClient
from ragkv.evals.testing import tiny_model_dir
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import ServerThread, build_index, settings

CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721. It was chosen by Alice.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob by the river in spring.",
}


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory: pytest.TempPathFactory):
    """The hybrid's index served with the KV tree, and without it."""
    from ragkv.server.assembly import build_pipeline

    model = tiny_model_dir(tmp_path_factory.mktemp("qwen3-next"), "qwen3_next", family=True)
    index = build_index(tmp_path_factory.mktemp("hybrid-index"), CORPUS, model)
    spec = (CollectionSpec("docs", index),)
    server = ServerThread(settings(indexes=spec, model=str(model), kv_tree_bytes=16 << 20), build_pipeline)
    plain = ServerThread(settings(indexes=spec, model=str(model)), build_pipeline)
    yield server, index, plain
    server.stop()
    plain.stop()


def test_the_index_holds_no_chunk_kv_for_a_hybrid(hybrid_server) -> None:
    from ragkv.retriever.manifest import read_manifest

    _, index, _ = hybrid_server
    manifest = read_manifest(index)
    assert not manifest.kv_precomputed and manifest.n_chunks >= 2
    assert not [p for p in (index / "kv").rglob("*") if p.is_file()] if (index / "kv").exists() else True


def test_a_hybrid_answers_in_full_mode_by_default_and_refuses_chunk_kv_modes(hybrid_server) -> None:
    server, _, plain = hybrid_server
    with RagClient(server.addr) as client, RagClient(plain.addr) as reference:
        first = client.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=6)
        text = "".join(first)
        assert first.result().usage.completion_tokens > 0
        full = reference.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=6,
                               mode="full")
        assert "".join(full) == text  # the default is full
        with pytest.raises(grpc.RpcError) as err:
            "".join(client.query("What is the secret number?", collection="docs", mode="blend"))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "'blend' is not served here (allowed: full)" in err.value.details()


def test_an_agents_next_call_on_a_hybrid_resumes_from_the_tree(hybrid_server) -> None:
    from ragkv.types import ChatRole, ChatTurn, ToolCall

    server, _, plain = hybrid_server
    call = ToolCall("call_0", "lookup", '{"page": 1}')
    turns = [ChatTurn(ChatRole.ASSISTANT, "", (call,)),
             ChatTurn(ChatRole.TOOL, "page 1: the archive lists 4721 as the secret number.", tool_call_id=call.id)]
    kwargs = dict(collection="docs", top_k=2, max_new_tokens=6)
    with RagClient(server.addr) as client, RagClient(plain.addr) as reference:
        q = "Who chose the secret number?"
        "".join(client.query(q, **kwargs))  # call 1: computed, remembered with its recurrent state
        second = client.query(q, agent_turns=turns, **kwargs)
        text = "".join(second)
        usage = second.result().usage
        assert usage.tree_prompt_tokens > 0 and usage.tree_prompt_tokens < usage.prompt_tokens
        assert text == "".join(reference.query(q, agent_turns=turns, **kwargs))
