"""Tenant isolation of the KV tree, from outside: one API key's conversation never shows in
another key's answer (tree tokens, cached tokens, tiers), while each key's own next call still
reads the tree. Tiny random Llama, gRPC and HTTP, the real pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import openai
import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from ragkv.types import ChatRole, ChatTurn, Tier, ToolCall
from tests.server.fakes import ServerThread, build_index, settings
from tests.server.test_kv_tree import CORPUS, QUESTION, RESULT

ALICE, BOB = "alice-secret-0123456789", "bob-secret-0123456789ab"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path):
    from ragkv.server.assembly import build_pipeline

    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.json"
    keys.write_text(json.dumps([{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}]))
    st = ServerThread(settings(indexes=(CollectionSpec("docs", build_index(root, CORPUS, tiny_llama_dir)),),
                               api_keys_file=keys, http_port=0, kv_tree_bytes=64 << 20), build_pipeline)
    yield st
    st.stop()


def _turns() -> list[ChatTurn]:
    call = ToolCall("call_0", "lookup", '{"page": 0}')
    return [ChatTurn(ChatRole.ASSISTANT, "", (call,)), ChatTurn(ChatRole.TOOL, RESULT, tool_call_id=call.id)]


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_another_key_asking_the_same_question_reads_nothing_of_the_first(server: ServerThread, mode: str) -> None:
    kwargs = dict(collection="docs", mode=mode, top_k=3, max_new_tokens=4, recompute_ratio=0.2)
    question = f"{QUESTION} ({mode})"
    with RagClient(server.addr, token=ALICE) as alice, RagClient(server.addr, token=BOB) as bob:
        first = alice.query(question, **kwargs)
        first_text, first_usage = "".join(first), first.result().usage
        assert first_usage.tree_prompt_tokens == 0
        again = alice.query(question, **kwargs)  # alice's own repeat: served from her tree path
        "".join(again)
        assert again.result().usage.tree_prompt_tokens > 0

        probe = bob.query(question, **kwargs)  # bob asks alice's exact question
        probe_text, probe_usage = "".join(probe), probe.result().usage
        assert probe_usage.tree_prompt_tokens == 0
        assert Tier.TREE not in {c.kv_tier for c in probe.chunks}
        # what bob sees is what a first asker sees: nothing of alice's traffic shows
        assert probe_usage.cached_prompt_tokens == first_usage.cached_prompt_tokens
        assert probe_text == first_text

        nxt = alice.query(question, agent_turns=_turns(), **kwargs)  # alice's loop goes on, from the tree
        "".join(nxt)
        assert nxt.result().usage.tree_prompt_tokens >= first_usage.prompt_tokens - 16


def test_a_cache_salt_separates_one_keys_requests(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key=ALICE,
                           max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Who met Bob by the river? (salted)"}]

    def ask(salt: str | None):
        extra = {"mode": "blend", "top_k": 2, **({"cache_salt": salt} if salt else {})}
        return client.chat.completions.create(model="docs", messages=messages, max_tokens=4, extra_body=extra)

    plain = ask(None)
    assert ask(None).usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens - 8  # the tree
    salted = ask("user-42")
    assert salted.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens
    assert ask("user-42").usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens - 8
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model="docs", messages=messages, max_tokens=4,
                                       extra_body={"cache_salt": "x" * 300})


def test_a_grpc_cache_salt_separates_one_keys_requests(server: ServerThread) -> None:
    """The gRPC request's `cache_salt`, as the HTTP body's: one key's salted requests share tree
    paths with the same salt only; a salt past 256 characters is INVALID_ARGUMENT naming it."""
    kwargs = dict(collection="docs", mode="blend", top_k=2, max_new_tokens=4)
    question = "Who met Bob by the river? (salted over gRPC)"
    with RagClient(server.addr, token=ALICE) as alice:

        def ask(salt: str | None) -> int:
            stream = alice.query(question, cache_salt=salt, **kwargs)
            "".join(stream)
            return stream.result().usage.tree_prompt_tokens

        assert ask(None) == 0
        assert ask(None) > 0  # the key's own path
        assert ask("user-42") == 0  # another tenant within the key: nothing of the unsalted path
        assert ask("user-42") > 0 and ask("user-7") == 0
        with pytest.raises(grpc.RpcError) as err:
            "".join(alice.query(question, cache_salt="x" * 300, **kwargs))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


def test_a_key_rotating_its_cache_salt_cannot_evict_another_keys_conversation(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The attack of issue 71: alice sends a new cache_salt on every request, so each looks like a
    new tenant; the tree's share (--kv-tree-key-share) counts per key, so her flood makes room
    from her own paths and bob's conversation is still served from the tree."""
    from ragkv.server.assembly import build_pipeline

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}]))
    index = build_index(tmp_path, CORPUS, tiny_llama_dir)
    kwargs = dict(collection="docs", mode="blend", top_k=2, max_new_tokens=4)

    def start(tree_bytes: int) -> ServerThread:
        return ServerThread(settings(indexes=(CollectionSpec("docs", index),), api_keys_file=keys,
                                     kv_tree_bytes=tree_bytes, kv_tree_key_share=0.5, kv_tree_host_bytes=0),
                            build_pipeline)

    probe = start(64 << 20)  # how many bytes one conversation keeps in the tree
    try:
        with RagClient(probe.addr, token=BOB) as bob:
            bob.query(QUESTION, **kwargs).result()
        one = probe.server.service.backend.parts().kv_tree.stats().nbytes
    finally:
        probe.stop()
    st = start(6 * one)  # room for six conversations; a key's share is three
    try:
        with RagClient(st.addr, token=ALICE) as alice, RagClient(st.addr, token=BOB) as bob:
            assert bob.query(QUESTION, **kwargs).result().usage.tree_prompt_tokens == 0
            for i in range(12):
                alice.query(QUESTION, cache_salt=f"rotating-{i}", **kwargs).result()
            tree = st.server.service.backend.parts().kv_tree
            assert tree.stats().evictions > 0  # the flood filled the tree: room was made, from her paths
            assert bob.query(QUESTION, **kwargs).result().usage.tree_prompt_tokens > 0
    finally:
        st.stop()
