"""The KV tree behind the server: an agent's tool loop reuses its earlier calls' KV, and every
answer is the one a server without the tree gives (tiny random Llama, gRPC and HTTP)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
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
QUESTION = "What is the secret number, and who chose it?"
RESULT = "The archive lists 4721 as the secret number. " * 6  # a tool result of a few dozen tokens


@pytest.fixture(scope="module")
def tree_index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return build_index(tmp_path_factory.mktemp("tree-index"), CORPUS, tiny_llama_dir)


@pytest.fixture(scope="module")
def servers(tree_index: Path):
    """The same index served with the KV tree and without it."""
    from ragkv.server.assembly import build_pipeline

    spec = (CollectionSpec("docs", tree_index),)
    with_tree = ServerThread(settings(indexes=spec, http_port=0, metrics_port=0, kv_tree_bytes=64 << 20),
                             build_pipeline)
    without = ServerThread(settings(indexes=spec), build_pipeline)
    yield with_tree, without
    with_tree.stop()
    without.stop()


def _post(base: str, route: str, question: str, extra: dict, chat_only: dict | None = None) -> tuple[int, dict]:
    """POST a short question with ragkv's `extra` fields to chat completions (with `chat_only`
    fields too) or the Responses API; (status, JSON body)."""
    if route == "responses":
        body = {"model": "docs", "input": question, "max_output_tokens": 3, **extra}
    else:
        body = {"model": "docs", "max_tokens": 3, "mode": "reuse", "top_k": 2, **(chat_only or {}), **extra,
                "messages": [{"role": "user", "content": question}]}
    req = urllib.request.Request(f"{base}/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _loop_turns(step: int) -> list[ChatTurn]:
    """The agent's turns after the question at a tool loop's step: a call and its result each."""
    turns: list[ChatTurn] = []
    for i in range(step):
        call = ToolCall(f"call_{i}", "lookup", f'{{"page": {i}}}')
        turns += [ChatTurn(ChatRole.ASSISTANT, "", (call,)), ChatTurn(ChatRole.TOOL, f"page {i}: {RESULT}",
                                                                      tool_call_id=call.id)]
    return turns


@pytest.mark.parametrize("mode", ["full", "reuse", "blend", "focus"])
def test_a_tool_loop_reuses_its_earlier_calls_and_answers_as_without_the_tree(servers, mode: str) -> None:
    with_tree, without = servers
    with RagClient(with_tree.addr) as tree_client, RagClient(without.addr) as plain_client:
        for step in range(4):
            kwargs = dict(collection="docs", mode=mode, top_k=3, max_new_tokens=6, recompute_ratio=0.2,
                          agent_turns=_loop_turns(step))
            a, b = tree_client.query(QUESTION, **kwargs), plain_client.query(QUESTION, **kwargs)
            text_a, text_b = "".join(a), "".join(b)
            usage_a, usage_b = a.result().usage, b.result().usage
            assert text_a == text_b, f"{mode} step {step}: the tree changed the answer"
            assert usage_a.prompt_tokens == usage_b.prompt_tokens
            assert usage_b.tree_prompt_tokens == 0
            if step == 0:
                assert Tier.TREE not in {c.kv_tier for c in a.chunks}
                prev_prompt = usage_a.prompt_tokens
                continue
            # every earlier call's prompt is held: only the newest call and result are computed
            new_tokens = usage_a.prompt_tokens - usage_a.tree_prompt_tokens
            assert usage_a.tree_prompt_tokens >= prev_prompt - 16, (step, usage_a, prev_prompt)  # all but its tail
            assert new_tokens <= usage_a.prompt_tokens - prev_prompt + 16, (step, usage_a, prev_prompt)
            assert usage_a.cached_prompt_tokens >= usage_a.tree_prompt_tokens
            if mode != "full":  # the chunks came with the context, from the tree, not from a tier
                assert {c.kv_tier for c in a.chunks} == {Tier.TREE}, a.chunks
            prev_prompt = usage_a.prompt_tokens


def test_openai_usage_reports_tree_tokens_as_cached_and_metrics_count_them(servers) -> None:
    with_tree, _ = servers
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{with_tree.server.http_port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Who met Bob by the river?"}]
    first = client.chat.completions.create(model="docs", messages=messages, max_tokens=4,
                                           extra_body={"mode": "blend", "top_k": 2})
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": RESULT}]
    second = client.chat.completions.create(model="docs", messages=messages, max_tokens=4,
                                            extra_body={"mode": "blend", "top_k": 2})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{with_tree.server.metrics_port}/metrics",
                                     timeout=10).read().decode()
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("ragkv_kv_tree_hits_total"))
    held = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("ragkv_kv_tree_bytes "))
    assert hits >= 1 and held > 0
    assert any(line.startswith("ragkv_kv_tree_warmed_tokens_total ") for line in metrics.splitlines())


def test_a_prompt_past_the_models_context_is_refused_naming_tokens(servers) -> None:
    with_tree, _ = servers
    long_turns = _loop_turns(1)[:1] + [ChatTurn(ChatRole.TOOL, "word " * 5000, tool_call_id="call_0")]
    with RagClient(with_tree.addr) as client:
        with pytest.raises(grpc.RpcError) as err:
            "".join(client.query(QUESTION, collection="docs", mode="reuse", max_new_tokens=8, agent_turns=long_turns))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens" in err.value.details() and "context of 4096" in err.value.details()


def test_retain_seconds_is_accepted_and_pins_and_bad_values_are_400_naming_it(servers) -> None:
    """ragkv's `retain_seconds` extra: a tool-calling answer's path is pinned that long (at most
    --kv-tree-retain-max-s, 60 s by default); a bad value is refused before any work."""
    with_tree, _ = servers
    base = f"http://127.0.0.1:{with_tree.server.http_port}/v1"
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a page up.",
                                               "parameters": {"type": "object", "properties": {}}}}]

    def post(retain: object, route: str = "chat/completions") -> tuple[int, dict]:
        return _post(base, route, "Where does the fox jump?", {"retain_seconds": retain},
                     {"tools": tools} if route == "chat/completions" else {})

    tree = with_tree.server.service.backend.parts().kv_tree
    status, _ = post(45)
    assert status == 200
    assert tree.stats().pinned_bytes > 0  # the answer may be a tool call: its path is pinned
    assert post(0)[0] == 200 and post(2.5)[0] == 200
    for bad in (-1, 61, "soon", True, [3]):
        status, body = post(bad)
        assert status == 400, (bad, body)
        assert body["error"]["param"] == "retain_seconds" and "retain_seconds" in body["error"]["message"], body
    assert post(30, "responses")[0] == 200  # the Responses API takes the same extra
    status, body = post(-1, "responses")
    assert status == 400 and body["error"]["param"] == "retain_seconds", body


def test_grpc_retain_seconds_is_accepted_and_past_the_servers_max_is_invalid_argument(servers) -> None:
    """The gRPC request's `retain_seconds`, as the HTTP extra: at most --kv-tree-retain-max-s (60 s
    by default), >= 0; a bad value is INVALID_ARGUMENT naming the field and the bound."""
    with_tree, _ = servers
    kwargs = dict(collection="docs", mode="reuse", top_k=2, max_new_tokens=3, tools=[{
        "type": "function", "function": {"name": "lookup", "description": "Look a page up.",
                                         "parameters": {"type": "object", "properties": {}}}}])
    with RagClient(with_tree.addr) as client:
        for ok in (45.0, 0.0):
            stream = client.query("Where does the fox jump? (gRPC)", retain_seconds=ok, **kwargs)
            "".join(stream)
            assert stream.result() is not None
        for bad, needle in ((61.0, "at most 60 s"), (-1.0, ">= 0"), (float("nan"), ">= 0")):
            with pytest.raises(grpc.RpcError) as err:
                "".join(client.query("Where does the fox jump? (gRPC)", retain_seconds=bad, **kwargs))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "retain_seconds" in err.value.details() and needle in err.value.details(), err.value.details()


def test_retain_priority_reaches_the_tree_and_bad_values_are_refused_naming_it(servers) -> None:
    """ragkv's `retain_priority` (-100..100): the answer's path carries it in the tree (HTTP
    body, Responses API, gRPC field); anything else is 400 / INVALID_ARGUMENT naming it."""
    with_tree, _ = servers
    base = f"http://127.0.0.1:{with_tree.server.http_port}/v1"
    tree = with_tree.server.service.backend.parts().kv_tree

    def post(priority: object, question: str, route: str = "chat/completions") -> tuple[int, dict]:
        return _post(base, route, question, {"retain_priority": priority})

    def priorities() -> set[int]:
        with tree._lock:
            return {n.priority for n in tree._all()}

    assert post(37, "Who met Bob by the river? (priority)")[0] == 200
    assert 37 in priorities()
    assert post(-100, "Who met Bob by the river? (responses)", "responses")[0] == 200
    assert -100 in priorities()
    for bad in (101, -101, 2.5, "high", True):
        status, body = post(bad, "Who met Bob?")
        assert status == 400 and body["error"]["param"] == "retain_priority", (bad, body)
    with RagClient(with_tree.addr) as client:
        stream = client.query("Where does the fox jump? (priority)", collection="docs", mode="reuse", top_k=2,
                              max_new_tokens=3, retain_priority=-42)
        "".join(stream)
        assert -42 in priorities()
        with pytest.raises(grpc.RpcError) as err:
            "".join(client.query("Where does the fox jump?", collection="docs", max_new_tokens=3,
                                 retain_priority=500))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "retain_priority" in err.value.details()


@pytest.fixture(scope="module")
def pooled_tree(tree_index: Path):
    """The index served with the KV tree and decode over one pool (as on CUDA): the tree's device
    tier is a share of the decode pool."""
    from ragkv.server.assembly import build_pipeline

    server = ServerThread(settings(indexes=(CollectionSpec("docs", tree_index),), kv_tree_bytes=16 << 20,
                                   decode_pool="on", metrics_port=0), build_pipeline)
    yield server
    server.stop()


@pytest.mark.parametrize("mode", ["full", "reuse", "blend", "focus"])
def test_over_one_pool_a_tool_loop_moves_no_kv_between_its_calls_and_the_tree(servers, pooled_tree, mode: str) -> None:
    """Issue 70: where the engine decodes over one pool, the tree keeps its device tier in it. Each
    call's answer goes into the tree where the request left it (no copy in), and the next call
    runs on from its leased path in place (no copy out): the answers are the tree-less server's."""
    from ragkv.engine.kv.tree import TreeTier

    _, without = servers
    engine = pooled_tree.server.service.backend.engine
    pool, shared = engine.decoder.pool, engine.conversations.tree._pools[TreeTier.DEVICE]
    assert shared.k is pool.k  # one pair of tensors for requests and the tree

    def counts() -> tuple[int, ...]:
        return pool.borrowed_tokens, pool.handed_tokens, pool.copied_tokens, shared.written_tokens, shared.read_tokens

    before, leased = counts(), 0
    with RagClient(pooled_tree.addr) as tree_client, RagClient(without.addr) as plain_client:
        for step in range(4):
            kwargs = dict(collection="docs", mode=mode, top_k=3, max_new_tokens=6, recompute_ratio=0.2,
                          agent_turns=_loop_turns(step))
            a, b = tree_client.query(QUESTION, **kwargs), plain_client.query(QUESTION, **kwargs)
            assert "".join(a) == "".join(b), f"{mode} step {step}: the tree changed the answer"
            leased += a.result().usage.tree_prompt_tokens
    borrowed, handed, copied, written, read = (x - y for x, y in zip(counts(), before))
    assert leased > 0 and borrowed == leased  # every token the tree supplied was read where it lies
    assert handed > 0 and written == 0  # every insert took the request's KV in place
    assert read == 0  # no lease copied its path out of the tree
    if mode != "focus":  # a focus pass runs in a cache of its own and moves into the pool to decode (not the tree's)
        assert copied == 0
    assert pool.used == pool.tree_tokens  # every request's run went back
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{pooled_tree.server.metrics_port}/metrics",
                                     timeout=10).read().decode()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.splitlines()
             if ln.startswith("ragkv_decode_pool_")}
    assert lines['ragkv_decode_pool_kv_tokens_total{how="lent"}'] == pool.borrowed_tokens > 0
    assert lines['ragkv_decode_pool_kv_tokens_total{how="handed"}'] == pool.handed_tokens > 0
    assert lines['ragkv_decode_pool_kv_tokens_total{how="rehomed"}'] == pool.rehomed_tokens
    assert lines['ragkv_decode_pool_kv_tokens_total{how="reclaimed"}'] == pool.reclaimed_tokens
    assert lines['ragkv_decode_pool_tokens{holder="tree"}'] == pool.tree_tokens > 0
    assert lines['ragkv_decode_pool_tokens{holder="requests"}'] == 0
    assert lines["ragkv_decode_pool_capacity_tokens"] == pool.capacity


def test_over_one_pool_a_path_copied_for_its_call_is_kept_where_the_copy_lies(servers, pooled_tree,
                                                                              monkeypatch) -> None:
    """Every lease refused its place (as when another call's run lies right after the path): each
    call copies its path in, and the insert after its answer keeps the path's device nodes in that
    copy (`KVCache.from_tree`, `DecodePool.rehome`) rather than where they were: the tree holds
    each conversation once, no KV moves for it, and the answers are the tree-less server's."""
    from ragkv.engine.kv.tree import TreeTier
    from ragkv.engine.kv.tree_node import TreeLease

    monkeypatch.setattr(TreeLease, "lend", lambda self, capacity, least=0: None)
    _, without = servers
    engine = pooled_tree.server.service.backend.engine
    pool, shared = engine.decoder.pool, engine.conversations.tree._pools[TreeTier.DEVICE]
    before = pool.rehomed_tokens, shared.read_tokens, shared.written_tokens
    with RagClient(pooled_tree.addr) as tree_client, RagClient(without.addr) as plain_client:
        for step in range(3):
            kwargs = dict(collection="docs", mode="reuse", top_k=3, max_new_tokens=6, agent_turns=_loop_turns(step))
            question = "Who chose the secret number? (its own conversation)"
            a, b = tree_client.query(question, **kwargs), plain_client.query(question, **kwargs)
            assert "".join(a) == "".join(b), f"step {step}: the tree changed the answer"
    rehomed, read, written = (x - y for x, y in zip((pool.rehomed_tokens, shared.read_tokens, shared.written_tokens),
                                                    before))
    assert read > 0  # the paths were copied in
    assert rehomed > 0 and written == 0  # and kept where the copies lay, nothing copied into the tree
    assert pool.used == pool.tree_tokens  # every request's run went back


def test_agents_side_by_side_through_a_small_pool_answer_as_without_the_tree(tmp_path, tiny_llama_dir) -> None:
    """Four agents' tool loops at once through one decode pool that holds a few of their calls,
    its tree's share most of it, with a host tier below: runs make the tree move nodes out of
    their way, paths are lent, copied and kept where copies lie, spilled and brought back, and
    admission turns calls away to be retried. Every answer is the tree-less server's, no call
    fails but for a full budget (RESOURCE_EXHAUSTED, retried), and every run goes back. (Run so,
    it found a host pool first written under inference mode, which admission's shrink could not
    write to after: INTERNAL errors; and, now and then on a loaded host, two agents refused 400
    times over: each refused call's tree leases were let go only when the collector found it, so
    the tree could not shrink for the retries.)"""
    import threading
    import time

    from ragkv.server.assembly import build_pipeline

    spec = (CollectionSpec("docs", build_index(tmp_path, CORPUS, tiny_llama_dir)),)
    plain = ServerThread(settings(indexes=spec), build_pipeline)
    per_token = plain.server.service.backend.engine.kv_bytes_per_token
    pooled = ServerThread(settings(indexes=spec, decode_pool="on", kv_budget_bytes=1500 * per_token,
                                   kv_tree_bytes=900 * per_token, kv_tree_host_bytes=1 << 20), build_pipeline)
    questions = [f"What is the secret number? Agent {i} asks." for i in range(4)]
    kwargs = dict(collection="docs", mode="blend", top_k=3, max_new_tokens=12, recompute_ratio=0.3)
    try:
        with RagClient(plain.addr) as client:
            want = {(q, s): "".join(client.query(q, agent_turns=_loop_turns(s), **kwargs))
                    for q in questions for s in range(4)}
        got: dict[tuple[str, int], str] = {}
        errors: list[str] = []

        def agent(q: str) -> None:
            with RagClient(pooled.addr) as client:
                for s in range(4):
                    for _ in range(400):
                        try:
                            got[(q, s)] = "".join(client.query(q, agent_turns=_loop_turns(s), **kwargs))
                            break
                        except grpc.RpcError as err:
                            if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                                errors.append(f"{err.code()}: {err.details()}")
                                return
                            refusal = err.details()
                            time.sleep(0.05)
                    else:
                        errors.append(f"{q!r} step {s}: refused 400 times, last: {refusal}")
                        return

        threads = [threading.Thread(target=agent, args=(q,)) for q in questions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        pool = pooled.server.service.backend.engine.decoder.pool
        assert not errors
        assert got == want
        assert pool.reclaimed_tokens > 0 and pool.handed_tokens > 0  # the pool was pressed, the tree kept calls
        assert pool.used == pool.tree_tokens  # every request's run went back
    finally:
        plain.stop()
        pooled.stop()
