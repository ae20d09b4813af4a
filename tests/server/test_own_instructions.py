"""Agents bring their own instructions (issue 74): a system message other than the one the
index was built with is served over the index's chunk KV, and an answer's length follows
OpenAI's convention when the client sets none.

On the real pipeline over the tiny random Llama (an index built with its own system prompt):
- the request's instructions go in front (`prefix`, the default): the chunks' KV is moved after
  them and blended; at recompute ratio 1.0 that is full prefill of the prompt the user sent;
- the second call of a tenant with the same instructions reads them from its KV tree; another
  tenant's same instructions do not;
- `--system-prompt-policy strict` refuses them as before; `suffix` serves them after the chunks.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import openai
import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import FakeBackend, ServerThread, settings
from tests.server.test_chat_pipeline import SYSTEM, chat_index  # noqa: F401  (module fixture, reused)

OWN = "You are a terse assistant. Answer with one word, then stop."
QUESTION = {"role": "user", "content": "What is the secret number?"}


def _server(index: Path, **kw: object) -> ServerThread:
    from ragkv.server.assembly import build_pipeline

    return ServerThread(settings(indexes=(CollectionSpec("docs", index),), http_port=0, **kw), build_pipeline)


def _client(st: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _ask(st: ServerThread, system: str | None = OWN, question: dict = QUESTION, **extra: object):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [question]
    return _client(st).chat.completions.create(model="docs", messages=messages, max_tokens=6,
                                               extra_body={"top_k": 2, **extra})


@pytest.fixture(scope="module")
def own_server(chat_index: Path):  # noqa: F811
    st = _server(chat_index, kv_tree_bytes=64 * 2**20)
    yield st
    st.stop()


def test_own_instructions_are_served_and_at_ratio_one_equal_full_prefill_of_the_prompt_sent(
        own_server: ServerThread) -> None:
    full = _ask(own_server, mode="full", cache_salt="a")
    blend = _ask(own_server, mode="blend", recompute_ratio=1.0, cache_salt="b")
    indexed = _ask(own_server, system=SYSTEM, mode="full", cache_salt="c")
    assert blend.model_extra["ragkv"]["system_prompt"] == "prefix"
    assert full.model_extra["ragkv"]["system_prompt"] == "prefix"
    assert indexed.model_extra["ragkv"]["system_prompt"] == "indexed"
    # the user's own instructions are in the prompt: more tokens than the index's prompt, and the
    # chunks' KV (stored after the index's prefix) moved after them and recomputed is exact
    assert full.usage.prompt_tokens != indexed.usage.prompt_tokens
    assert blend.usage.prompt_tokens == full.usage.prompt_tokens
    assert blend.choices[0].message.content == full.choices[0].message.content
    reuse = _ask(own_server, mode="reuse", cache_salt="d")  # the chunks' KV read from the tiers, not recomputed
    assert reuse.model_extra["ragkv"]["recompute_fraction"] == 0.0
    assert {s["kv_tier"] for s in reuse.model_extra["ragkv"]["sources"]} <= {"disk", "cpu"}


def test_a_tenants_second_call_reads_its_instructions_from_the_tree_and_another_tenants_does_not(
        own_server: ServerThread) -> None:
    own = "Answer like a careful librarian, in few words."
    first = _ask(own_server, own, cache_salt="tenant-1", mode="blend")
    again = _ask(own_server, own, {"role": "user", "content": "Who met Bob?"}, cache_salt="tenant-1", mode="blend")
    other = _ask(own_server, own, {"role": "user", "content": "Who met Bob?"}, cache_salt="tenant-2", mode="blend")
    assert first.model_extra["ragkv"]["tree_prompt_tokens"] == 0
    assert "instructions" in first.model_extra["ragkv"]["phase_seconds"]  # computed for the first call
    # another question (other chunks): the context is new, but the instructions are the tree's
    prefix_tokens = _prefix_tokens(own_server, own)
    assert again.model_extra["ragkv"]["tree_prompt_tokens"] == prefix_tokens > 0
    assert "instructions" not in again.model_extra["ragkv"]["phase_seconds"]
    assert again.usage.prompt_tokens_details.cached_tokens >= prefix_tokens
    assert other.model_extra["ragkv"]["tree_prompt_tokens"] == 0
    assert "instructions" in other.model_extra["ragkv"]["phase_seconds"]


def _prefix_tokens(st: ServerThread, system: str) -> int:
    pipeline = st.server.service.backend
    return len(pipeline.engine.prompt.with_system(system).prefix_ids())


def test_strict_policy_refuses_another_system_prompt_over_both_apis(chat_index: Path) -> None:  # noqa: F811
    st = _server(chat_index, system_prompt_policy="strict")
    try:
        with pytest.raises(openai.BadRequestError) as info:
            _ask(st, "Talk like a pirate.")
        message = info.value.body["message"]
        assert "Talk like a pirate." in message and SYSTEM in message and info.value.body["param"] == "system_prompt"
        assert _ask(st, SYSTEM).model_extra["ragkv"]["system_prompt"] == "indexed"
        with RagClient(st.addr, timeout=60) as client, pytest.raises(grpc.RpcError) as rpc:
            client.query("q", collection="docs", system_prompt="Another prompt.").result()
        assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        st.stop()


def test_suffix_policy_places_the_instructions_after_the_chunks(chat_index: Path) -> None:  # noqa: F811
    st = _server(chat_index, system_prompt_policy="suffix")
    try:
        own = _ask(st, mode="reuse")
        indexed = _ask(st, SYSTEM, mode="reuse")
        assert own.model_extra["ragkv"]["system_prompt"] == "suffix"
        # the index's prefix and the chunks' KV as stored, then the instructions: more prompt
        # tokens, the same ones cached
        assert own.usage.prompt_tokens > indexed.usage.prompt_tokens
        assert own.usage.prompt_tokens_details.cached_tokens == indexed.usage.prompt_tokens_details.cached_tokens
        with RagClient(st.addr, timeout=60) as client:
            stats = client.query("What is the secret number?", collection="docs", system_prompt=OWN,
                                 max_new_tokens=3).result()
        assert stats.system_prompt.value == "suffix"
    finally:
        st.stop()


# -- output length: OpenAI's convention


@pytest.fixture()
def long_answers():
    backend = FakeBackend(n_pieces=100)  # the fake's answer ends by itself after 100 tokens
    st = ServerThread(settings(http_port=0, max_new_tokens=512), lambda s: backend)
    yield st
    st.stop()


def test_without_max_tokens_an_answer_longer_than_64_tokens_is_complete(long_answers: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{long_answers.server.http_port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="default", messages=[QUESTION])
    assert chat.usage.completion_tokens == 100 and chat.choices[0].finish_reason == "stop"
    assert chat.model_extra["ragkv"]["length_limit"] is None
    streamed = client.chat.completions.create(model="default", messages=[QUESTION], stream=True)
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    response = client.responses.create(model="default", input="What is the secret number?")
    assert response.status == "completed" and response.incomplete_details is None
    assert response.max_output_tokens is None and response.usage.output_tokens == 100
    with RagClient(long_answers.addr, timeout=60) as rag:
        stats = rag.query("What is the secret number?").result()
    assert stats.usage.completion_tokens == 100 and stats.finish_reason.value == "stop" and stats.length_limit is None


def test_a_clients_max_tokens_cuts_the_answer_and_says_so(long_answers: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{long_answers.server.http_port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="default", messages=[QUESTION], max_tokens=5)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    assert chat.model_extra["ragkv"]["length_limit"] == "max_tokens"
    response = client.responses.create(model="default", input="What is the secret number?", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 5
    with RagClient(long_answers.addr, timeout=60) as rag:
        stats = rag.query("What is the secret number?", max_new_tokens=5).result()
    assert stats.finish_reason.value == "length" and stats.length_limit.value == "max_tokens"


def test_the_servers_cap_ends_an_answer_that_sets_no_limit_and_says_so() -> None:
    backend = FakeBackend(n_pieces=100)
    st = ServerThread(settings(http_port=0, max_new_tokens=40), lambda s: backend)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none", max_retries=0,
                               timeout=60)
        chat = client.chat.completions.create(model="default", messages=[QUESTION])
        assert chat.usage.completion_tokens == 40 and chat.choices[0].finish_reason == "length"
        assert chat.model_extra["ragkv"]["length_limit"] == "server_cap"
    finally:
        st.stop()


def test_without_max_tokens_the_context_left_bounds_the_answer(chat_index: Path) -> None:  # noqa: F811
    """The tiny random model never stops by itself: with no max_tokens it writes until the context
    is full (its max_position_embeddings, shrunk here), and the reason says the context ended it."""
    st = _server(chat_index)
    try:
        pipeline = st.server.service.backend
        config = pipeline.lm.model.config
        saved = config.max_position_embeddings
        with RagClient(st.addr, timeout=120) as rag:
            prompt = rag.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=1,
                               mode="reuse").result().usage.prompt_tokens
            config.max_position_embeddings = prompt + 30
            try:
                stats = rag.query("What is the secret number?", collection="docs", top_k=2, mode="reuse").result()
                with pytest.raises(grpc.RpcError) as info:  # a client's max_tokens past the context is refused
                    rag.query("What is the secret number?", collection="docs", top_k=2, max_new_tokens=31).result()
            finally:
                config.max_position_embeddings = saved
        assert stats.usage.completion_tokens == 30 and stats.finish_reason.value == "length"
        assert stats.length_limit.value == "context"
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        st.stop()


def test_a_follow_up_with_own_instructions_carries_its_earlier_turns(own_server: ServerThread) -> None:
    """A follow-up that retrieves other chunks carries the conversation's earlier turns from the
    tree (computed after the request's own prefix, so not moved again) and answers at ratio 1.0
    as full prefill of the same prompt does."""
    own = "You are a quiz master who answers with numbers."
    first = _ask(own_server, own, cache_salt="follow", mode="blend")
    history = [{"role": "system", "content": own}, QUESTION,
               {"role": "assistant", "content": first.choices[0].message.content}]
    follow_up = {"role": "user", "content": "And who met Bob, and where is the quick brown fox?"}

    def ask(**extra: object):
        return _client(own_server).chat.completions.create(model="docs", messages=[*history, follow_up], max_tokens=4,
                                                           extra_body={"top_k": 2, **extra})

    carried = ask(cache_salt="follow", mode="blend")
    assert carried.model_extra["ragkv"]["system_prompt"] == "prefix"
    assert carried.model_extra["ragkv"]["tree_prompt_tokens"] > 0  # the earlier turns, from the tree
    exact = ask(cache_salt="follow-exact", mode="blend", recompute_ratio=1.0)
    full = ask(cache_salt="follow-full", mode="full")
    assert exact.choices[0].message.content == full.choices[0].message.content


def test_own_instructions_take_their_own_default_ratio_unless_the_client_sets_one(
        chat_index: Path) -> None:  # noqa: F811
    """--system-prompt-recompute-ratio: none of the chunks' KV is exact after another prefix, so
    a request with its own instructions that sets no ratio takes the server's ratio for those."""
    st = _server(chat_index, default_recompute_ratio=0.1, system_prompt_recompute_ratio=0.5)
    try:
        own = _ask(st, mode="blend").model_extra["ragkv"]
        indexed = _ask(st, SYSTEM, mode="blend").model_extra["ragkv"]
        chosen = _ask(st, mode="blend", recompute_ratio=0.2).model_extra["ragkv"]
        assert own["system_prompt"] == "prefix" and abs(own["recompute_fraction"] - 0.5) < 0.05
        assert indexed["system_prompt"] == "indexed" and indexed["recompute_fraction"] < 0.15
        assert abs(chosen["recompute_fraction"] - 0.2) < 0.05
    finally:
        st.stop()
