"""A follow-up question that retrieves other chunks carries its conversation's earlier turns
from the KV tree as one more chunk (blend mode), instead of computing them again (tiny
random Llama, gRPC)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from ragkv.types import ChatRole, ChatTurn, Tier, ToolCall
from tests.server.fakes import ServerThread, build_index, settings

CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721. It was chosen by Alice.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob by the river in spring.",
    "ragkv.txt": "ragkv stores the KV cache of every chunk and blends them at query time, fast.",
}
# a chat template, so the conversation renders as turns (a tokenizer without one lays the earlier
# turns out as text before the question, which no earlier call's prompt begins with)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
FIRST, FOLLOW_UP = "What is the secret number of Paris?", "What does ragkv store, and when does it blend?"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    model = tmp_path_factory.mktemp("chat-llama") / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return model


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, chat_model: Path):
    from ragkv.server.assembly import build_pipeline

    index = build_index(tmp_path_factory.mktemp("follow-index"), CORPUS, chat_model)
    spec = (CollectionSpec("docs", index),)
    with_tree = ServerThread(settings(indexes=spec, kv_tree_bytes=64 << 20), build_pipeline)
    without = ServerThread(settings(indexes=spec), build_pipeline)
    yield with_tree, without
    with_tree.stop()
    without.stop()


def _ask(client: RagClient, question: str, history: list[ChatTurn], ratio: float, **extra: object):
    stream = client.query(question, collection="docs", mode="blend", top_k=1, max_new_tokens=8, recompute_ratio=ratio,
                          history=history, **extra)
    text = "".join(stream)
    return text, stream.result(), stream.chunks


@pytest.mark.parametrize("ratio", [1.0, 0.2])
def test_a_follow_up_over_other_chunks_carries_the_earlier_turns(servers, ratio: float) -> None:
    with_tree, without = servers
    with RagClient(with_tree.addr) as tree_client, RagClient(without.addr) as plain:
        first, _, first_chunks = _ask(tree_client, FIRST, [], ratio)
        history = [ChatTurn(ChatRole.USER, FIRST), ChatTurn(ChatRole.ASSISTANT, first)]
        text, stats, chunks = _ask(tree_client, FOLLOW_UP, history, ratio)
        want, plain_stats, plain_chunks = _ask(plain, FOLLOW_UP, history, ratio)
    assert [c.chunk_id for c in chunks] == [c.chunk_id for c in plain_chunks] != [c.chunk_id for c in first_chunks]
    assert stats.usage.prompt_tokens == plain_stats.usage.prompt_tokens  # the same prompt
    # the earlier turns came from the tree as a chunk: cached, not computed, and counted as the tree's
    assert stats.usage.cached_prompt_tokens > plain_stats.usage.cached_prompt_tokens
    assert stats.usage.tree_prompt_tokens > 0 == plain_stats.usage.tree_prompt_tokens
    if ratio == 1.0:  # every chunk token recomputed: full prefill's answer, as without the tree
        assert text == want


def test_a_tool_loop_after_a_follow_up_finds_the_context_the_follow_up_left(servers) -> None:
    with_tree, _ = servers
    with RagClient(with_tree.addr) as client:
        first, _, _ = _ask(client, FIRST, [], 0.2)
        history = [ChatTurn(ChatRole.USER, FIRST), ChatTurn(ChatRole.ASSISTANT, first)]
        _, follow, _ = _ask(client, FOLLOW_UP, history, 0.2)
        call = ChatTurn(ChatRole.ASSISTANT, "", (ToolCall("c1", "lookup", '{"page": 1}'),))
        agent = [call, ChatTurn(ChatRole.TOOL, "The store holds every chunk's KV cache.", tool_call_id="c1")]
        stream = client.query(FOLLOW_UP, collection="docs", mode="blend", top_k=1, max_new_tokens=8,
                              recompute_ratio=0.2, history=history, agent_turns=agent)
        "".join(stream)
        loop = stream.result()
        chunks = stream.chunks
    assert loop.usage.tree_prompt_tokens >= follow.usage.prompt_tokens - 16, (loop.usage, follow.usage)
    assert {c.kv_tier for c in chunks} == {Tier.TREE}


def test_with_follow_ups_off_the_earlier_turns_are_computed_again(servers, chat_model: Path,
                                                                   tmp_path: Path) -> None:
    from ragkv.server.assembly import build_pipeline

    _, without = servers
    index = build_index(tmp_path, CORPUS, chat_model)
    off = ServerThread(settings(indexes=(CollectionSpec("docs", index),), kv_tree_bytes=64 << 20,
                                kv_tree_follow_ups=False), build_pipeline)
    try:
        with RagClient(off.addr) as client, RagClient(without.addr) as plain:
            first, _, _ = _ask(client, FIRST, [], 0.2)
            history = [ChatTurn(ChatRole.USER, FIRST), ChatTurn(ChatRole.ASSISTANT, first)]
            _, stats, _ = _ask(client, FOLLOW_UP, history, 0.2)
            _, plain_stats, _ = _ask(plain, FOLLOW_UP, history, 0.2)
    finally:
        off.stop()
    assert stats.usage.cached_prompt_tokens == plain_stats.usage.cached_prompt_tokens
