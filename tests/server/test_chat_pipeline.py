"""The real pipeline (tiny random Llama) behind the OpenAI-compatible API: an index built with its
own system prompt and int8 KV files, served over HTTP and gRPC; chat history reaches the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from ragkv.types import ChatRole, ChatTurn
from tests.server.fakes import ServerThread, settings

SYSTEM = "You are the ragkv test oracle. Reply with one number."
CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob.",
    "ragkv.txt": "ragkv stores the KV cache of every chunk and blends them at query time.",
}


@pytest.fixture(scope="module")
def chat_index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    root = tmp_path_factory.mktemp("chat-index")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", model=str(tiny_llama_dir), progress=False,
                             chunking=ChunkingConfig(size=32, overlap=0), system_prompt=SYSTEM,
                             kv_compression="int8"))
    return root / "index"


@pytest.fixture(scope="module")
def chat_server(chat_index: Path):
    from ragkv.server.assembly import build_pipeline

    st = ServerThread(settings(indexes=(CollectionSpec("docs", chat_index),), http_port=0), build_pipeline)
    yield st
    st.stop()


def test_manifest_records_the_system_prompt_in_the_prefix(chat_index: Path, tiny_llama_dir: Path) -> None:
    from ragkv.engine import Engine, load_model
    from ragkv.kvstore.fileformat import read_header

    manifest = json.loads((chat_index / "manifest.json").read_text())
    assert manifest["system_prompt"] == SYSTEM and manifest["kv_compression"] == "int8"
    engine = Engine(load_model(str(tiny_llama_dir)), system_prompt=SYSTEM)
    assert manifest["prefix_ids"] == engine.prompt.prefix_ids()
    default = Engine(engine.lm)
    assert default.prompt.prefix_ids() != manifest["prefix_ids"]  # so every chunk key differs too
    files = list((chat_index / "kv").rglob("*.safetensors"))
    assert files and {read_header(f.read_bytes()).compression.value for f in files} == {"int8"}


def test_openai_client_on_the_real_pipeline(chat_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{chat_server.server.http_port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    question = {"role": "user", "content": "What is the secret number?"}
    plain = client.chat.completions.create(model="docs", messages=[{"role": "system", "content": SYSTEM}, question],
                                           max_tokens=4, extra_body={"mode": "reuse", "top_k": 2})
    sources = plain.model_extra["ragkv"]["sources"]
    assert len(sources) == 2 and {s["kv_tier"] for s in sources} <= {"disk", "cpu"}
    assert plain.usage.completion_tokens >= 1
    assert 0 < plain.usage.prompt_tokens_details.cached_tokens < plain.usage.prompt_tokens
    # history goes into the (recomputed) question segment: more prompt tokens, same cached chunks
    turns = [{"role": "user", "content": "Who met Bob?"}, {"role": "assistant", "content": "Alice met Bob."}]
    with_history = client.chat.completions.create(model="docs", messages=[*turns, question], max_tokens=4,
                                                  extra_body={"mode": "reuse", "top_k": 2})
    assert [s["chunk_id"] for s in with_history.model_extra["ragkv"]["sources"]] == [s["chunk_id"] for s in sources]
    assert with_history.usage.prompt_tokens > plain.usage.prompt_tokens
    assert with_history.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens
    streamed = client.chat.completions.create(model="docs", messages=[question], max_tokens=4, stream=True,
                                              extra_body={"mode": "reuse", "top_k": 2})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content  # greedy, same prompt: same answer
    # another system prompt is served in front of the index's chunks (strict refuses it:
    # tests/server/test_own_instructions.py)
    pirate = client.chat.completions.create(model="docs", max_tokens=4, extra_body={"mode": "reuse", "top_k": 2},
                                            messages=[{"role": "system", "content": "Talk like a pirate."}, question])
    assert pirate.model_extra["ragkv"]["system_prompt"] == "prefix"
    assert plain.model_extra["ragkv"]["system_prompt"] == "indexed"


def test_grpc_system_prompt_and_history_on_the_real_pipeline(chat_server: ServerThread) -> None:
    with RagClient(chat_server.addr, timeout=60) as client:
        history = [ChatTurn(ChatRole.USER, "Who met Bob?"), ChatTurn(ChatRole.ASSISTANT, "Alice did.")]
        plain = client.query("What is the secret number?", collection="docs", mode="reuse", max_new_tokens=3,
                             top_k=2).result()
        longer = client.query("What is the secret number?", collection="docs", mode="reuse", max_new_tokens=3,
                              top_k=2, history=history, system_prompt=SYSTEM).result()
        assert longer.usage.prompt_tokens > plain.usage.prompt_tokens
        other = client.query("q", collection="docs", system_prompt="Another prompt.", max_new_tokens=2).result()
    assert other.system_prompt.value == "prefix" and longer.system_prompt.value == "indexed"
