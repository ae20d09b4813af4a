"""A hybrid model (recurrent Gated DeltaNet layers between attention layers) end to end: the
index skips chunk KV it could never reuse, the server answers in FULL mode by default, exactly
as the engine's own full prefill, and refuses a chunk-KV mode naming the one it serves."""

from __future__ import annotations

from pathlib import Path

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
    from ragkv.server.pipeline import Pipeline

    model = tiny_model_dir(tmp_path_factory.mktemp("qwen3-next"), "qwen3_next", family=True)
    index = build_index(tmp_path_factory.mktemp("hybrid-index"), CORPUS, model)
    server = ServerThread(settings(indexes=(CollectionSpec("docs", index),), model=str(model),
                                   kv_tree_bytes=16 << 20), Pipeline.from_settings)
    yield server, index
    server.stop()


def test_the_index_holds_no_chunk_kv_for_a_hybrid(hybrid_server) -> None:
    from ragkv.retriever.manifest import read_manifest

    _, index = hybrid_server
    manifest = read_manifest(index)
    assert not manifest.kv_precomputed and manifest.n_chunks >= 2
    assert not [p for p in (index / "kv").rglob("*") if p.is_file()] if (index / "kv").exists() else True


def test_a_hybrid_answers_in_full_mode_by_default_and_refuses_chunk_kv_modes(hybrid_server) -> None:
    server, _ = hybrid_server
    with RagClient(server.addr) as client:
        first = client.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=6)
        text = "".join(first)
        assert first.result().usage.completion_tokens > 0
        again = client.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=6,
                             mode="full")
        assert "".join(again) == text  # the default is full, and the tree (off for a hybrid) changes nothing
        assert again.result().usage.tree_prompt_tokens == 0
        with pytest.raises(grpc.RpcError) as err:
            "".join(client.query("What is the secret number?", collection="docs", mode="blend"))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "'blend' is not served here (allowed: full)" in err.value.details()
