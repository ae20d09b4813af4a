"""The KV tree: the radix tree itself, and reuse that changes no answer in any mode."""

from __future__ import annotations

import gc

import pytest
import torch

from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, SamplingParams, TreeConfig, load_model
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.tree import KVTree, ToolLatency, TreeContext, TreeKey
from ragkv.evals.testing import FAMILY_CONFIGS, HYBRIDS, tiny_model_dir
from ragkv.types import SALT_SEP, Mode

CHUNKS = [
    "Paris is the capital of France. The secret number is 4721.",
    "Alice met Bob by the river. The quick brown fox jumps over the lazy dog.",
    "ragkv stores the KV cache of every chunk and blends them at query time.",
]
QUESTION = "What is the secret number?"
TOOL_TURN = "\nTool: the archive says 4721, chosen by Alice in Paris.\n"
CTX = TreeContext(prefix_tokens=0, chunk_end=0, chunk_tokens=0)


def _cache(n: int, fill: float = 0.0) -> KVCache:
    """A cache of n tokens whose K/V at slot j hold j + fill (so copies can be checked)."""
    cache = KVCache(2, 1, 3, n + 4, torch.float32, torch.device("cpu"))
    cache.k[:, :, :n] = torch.arange(n, dtype=torch.float32)[None, None, :, None] + fill
    cache.v[:, :, :n] = -cache.k[:, :, :n]
    cache.length = n
    return cache


def _bytes(tokens: int) -> int:
    return 2 * 2 * 1 * tokens * 3 * 4  # K and V, [L=2, Hkv=1, T, D=3], float32


def test_match_returns_the_longest_path_and_leaves_a_token_to_compute():
    tree, key = KVTree(10**6), TreeKey.of("ctx")
    assert tree.match(key, [1, 2, 3]) is None  # no context yet
    tree.insert(key, [7, 8], CTX, [1, 2, 3, 4], _cache(6))
    lease = tree.match(key, [1, 2, 3, 9])
    assert (lease.context_ids, lease.matched, lease.tokens) == ((7, 8), 3, 5)
    out = KVCache(2, 1, 3, 8, torch.float32, torch.device("cpu"))
    lease.write_into(out)
    assert torch.equal(out.k[:, :, :5], _cache(6).k[:, :, :5])
    lease.release()
    whole = tree.match(key, [1, 2, 3, 4])  # everything held: the last token is still computed
    assert whole.matched == 3
    whole.release()


def test_a_diverging_insert_splits_the_edge_and_keeps_both_branches():
    tree, key = KVTree(10**6), TreeKey.of("ctx")
    tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4))
    assert tree.insert(key, [], CTX, [1, 2, 5, 6], _cache(4, fill=100)) == 2
    for ids, want in (([1, 2, 3, 4, 0], 0.0), ([1, 2, 5, 6, 0], 100.0)):
        lease = tree.match(key, ids)
        assert lease.matched == 4
        out = KVCache(2, 1, 3, 8, torch.float32, torch.device("cpu"))
        lease.write_into(out)
        assert out.k[0, 0, 3, 0].item() == 3 + want  # the branch's own KV, past the split
        assert out.k[0, 0, 1, 0].item() == 1  # the shared part: the first insert's
        lease.release()
    assert tree.stats().nbytes == _bytes(6)


def test_eviction_is_lru_over_unleased_leaves_within_the_budget():
    tree = KVTree(_bytes(8))
    a, b, c = TreeKey.of("a"), TreeKey.of("b"), TreeKey.of("c")
    tree.insert(a, [], CTX, [1, 2, 3], _cache(3))
    tree.insert(b, [], CTX, [4, 5, 6], _cache(3))
    held = tree.match(a, [1, 2, 3, 0])  # a is older, but leased
    tree.insert(c, [], CTX, [7, 8, 9], _cache(3))  # needs room: b goes, not the leased a
    assert tree.match(b, [4, 5, 6]) is None
    assert tree.stats().nbytes <= _bytes(8) and tree.stats().evictions == 1
    held.release()
    tree.match(c, [7, 8, 9]).release()  # c is now the most recent
    tree.insert(b, [], CTX, [4, 5, 6], _cache(3))
    assert tree.match(a, [1, 2]) is None  # a, least recently used and no longer leased, went
    assert tree.stats().nbytes <= _bytes(8)


def test_an_insert_beyond_the_budget_stores_nothing_and_a_zero_budget_is_off():
    tree = KVTree(_bytes(2))
    assert tree.insert(TreeKey.of("x"), [], CTX, [1, 2, 3], _cache(3)) == 0
    assert tree.stats().nbytes == 0
    off = KVTree(0)
    assert not off.enabled and off.insert(TreeKey.of("x"), [], CTX, [1], _cache(1)) == 0
    with pytest.raises(ValueError, match="budget"):
        KVTree(-1)


def test_one_tenants_flood_evicts_its_own_paths_not_every_other_tenants():
    tree = KVTree(_bytes(12), tenant_share=0.5)
    for i in range(2):  # bob's two conversations, then a flood of alice's
        tree.insert(TreeKey.of("bob", i, tenant="bob"), [], CTX, [i, 1, 2], _cache(3))
    for i in range(10):
        tree.insert(TreeKey.of("alice", i, tenant="alice"), [], CTX, [i, 1, 2], _cache(3))
    assert tree.tenant_bytes("alice") <= _bytes(6)  # past her share she makes room from her own paths
    for i in range(2):
        lease = tree.match(TreeKey.of("bob", i, tenant="bob"), [i, 1, 2, 3])
        assert lease is not None and lease.matched == 3
        lease.release()
    assert tree.match(TreeKey.of("alice", 9, tenant="alice"), [9, 1, 2, 3]) is not None  # her newest is kept
    # alone in the tree a tenant may use all of it
    solo = KVTree(_bytes(12), tenant_share=0.5)
    for i in range(4):
        solo.insert(TreeKey.of("alice", i, tenant="alice"), [], CTX, [i, 1, 2], _cache(3))
    assert solo.tenant_bytes("alice") == _bytes(12)
    # without a share (1.0) the flood takes every byte, bob's included: what the share prevents
    lru = KVTree(_bytes(12))
    lru.insert(TreeKey.of("bob", 0, tenant="bob"), [], CTX, [0, 1, 2], _cache(3))
    for i in range(10):
        lru.insert(TreeKey.of("alice", i, tenant="alice"), [], CTX, [i, 1, 2], _cache(3))
    assert lru.match(TreeKey.of("bob", 0, tenant="bob"), [0, 1, 2, 3]) is None
    assert TreeKey.of("x", tenant="a") != TreeKey.of("x", tenant="b")
    with pytest.raises(ValueError, match="tenant share"):
        KVTree(10, tenant_share=0.0)


def test_a_lease_dropped_unreleased_is_released_and_a_leased_edge_is_not_split():
    tree, key = KVTree(10**6), TreeKey.of("ctx")
    tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4))
    lease = tree.match(key, [1, 2, 3, 4, 5])
    assert tree.insert(key, [], CTX, [1, 2, 9], _cache(3)) == 0  # would split a leased edge
    del lease
    gc.collect()
    assert tree.insert(key, [], CTX, [1, 2, 9], _cache(3)) == 1
    tree.clear()
    assert tree.stats().nbytes == 0


def test_shrink_evicts_down_to_a_limit_but_keeps_leased_paths():
    tree = KVTree(10**6)
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [], CTX, [1, 2, 3], _cache(3))
    tree.insert(b, [], CTX, [4, 5, 6], _cache(3))
    held = tree.match(b, [4, 5, 6, 0])
    assert tree.shrink(0) == _bytes(3) == tree.nbytes  # a went; the leased b stays
    assert tree.match(a, [1, 2, 3]) is None
    held.release()
    assert tree.shrink(0) == 0


class _Clock:
    """An injected clock (`KVTree(clock=...)`): seconds that move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _flood(tree: KVTree, n: int, tag: str = "flood", tenant: str = "") -> None:
    """n other conversations of 3 tokens each, none pinned."""
    for i in range(n):
        tree.insert(TreeKey.of(tag, i, tenant=tenant), [], CTX, [i, 5, 6], _cache(3))


def _held(tree: KVTree, key: TreeKey, ids: list[int]) -> int:
    """Tokens of `ids` the tree holds under `key` (a match, released at once)."""
    lease = tree.match(key, ids)
    if lease is None:
        return 0
    lease.release()
    return lease.matched


def test_a_pinned_path_survives_a_flood_that_evicts_unpinned_ones():
    clock = _Clock()
    tree, agent, chat = KVTree(_bytes(9), clock=clock), TreeKey.of("agent"), TreeKey.of("chat")
    tree.insert(agent, [], CTX, [1, 2, 3], _cache(3), pin_s=30.0, parts_at=2)  # may end in tool calls
    tree.insert(chat, [], CTX, [1, 2, 3], _cache(3))  # a plain answer, more recent
    assert tree.stats().pinned_bytes == _bytes(3)
    clock.now += 10
    _flood(tree, 10)
    assert tree.stats().nbytes <= _bytes(9)
    assert _held(tree, chat, [1, 2, 3, 4]) == 0  # LRU took the unpinned one
    assert tree.stats().pinned_bytes == _bytes(3)
    # the flood's own newest paths are kept beside the pin, its oldest went
    assert _held(tree, TreeKey.of("flood", 9), [9, 5, 6, 0]) == 3 and _held(tree, TreeKey.of("flood", 0), [0, 5, 6, 0]) == 0
    # when only live pins are left, an insert stores less rather than evict one
    full = KVTree(_bytes(6), clock=clock)
    for i in range(2):
        full.insert(TreeKey.of("a", i), [], CTX, [1, 2, 3], _cache(3), pin_s=30.0)
    assert full.insert(chat, [], CTX, [1, 2, 3], _cache(3)) == 0 and full.stats().nbytes == _bytes(6)
    # admission's shrink takes them, after every unpinned leaf, the soonest-ending pin first
    full.insert(TreeKey.of("a", 0), [], CTX, [1, 2, 3], _cache(3), pin_s=60.0)  # a0 now ends later than a1
    assert full.shrink(_bytes(3)) == _bytes(3)
    assert _held(full, TreeKey.of("a", 0), [1, 2, 3, 4]) == 3 and _held(full, TreeKey.of("a", 1), [1, 2, 3, 4]) == 0


def test_an_expired_pin_is_evicted_like_any_leaf():
    clock = _Clock()
    tree, agent = KVTree(_bytes(9), clock=clock), TreeKey.of("agent")
    tree.insert(agent, [], CTX, [1, 2, 3], _cache(3), pin_s=5.0, parts_at=2)
    _flood(tree, 2)
    clock.now += 5.5  # the pin ended: the agent's path is the least recently used leaf
    assert tree.stats().pinned_bytes == 0
    _flood(tree, 1, tag="later")
    assert _held(tree, agent, [1, 2, 3, 4]) == 0
    assert _held(tree, TreeKey.of("flood", 0), [0, 5, 6, 0]) == 3  # the younger unpinned ones stay


def test_the_next_calls_lease_ends_the_pin_and_its_insert_pins_again():
    clock = _Clock()
    tree, agent = KVTree(_bytes(12), clock=clock), TreeKey.of("agent")
    tree.insert(agent, [], CTX, [1, 2, 3, 4, 5, 6], _cache(6), pin_s=30.0, parts_at=4)  # prompt 1..4, answer 5, 6
    # another conversation parting from this one inside its prompt passes through: the pin stays
    other = tree.match(agent, [1, 2, 9, 9])
    assert other.matched == 2
    other.release()
    assert tree.stats().pinned_bytes == _bytes(6) and tree.stats().tool_gaps == 0
    # the agent's next call (its tool call re-rendered, then the result) reaches the prompt's end
    clock.now += 2.0
    nxt = tree.match(agent, [1, 2, 3, 4, 7, 8, 9])
    assert nxt.matched == 4
    nxt.release()
    assert tree.stats().pinned_bytes == 0 and tree.stats().tool_gaps == 1
    _flood(tree, 4)  # unpinned, the path is LRU's again
    assert _held(tree, agent, [1, 2, 3, 4, 0]) == 0
    # the next call's own insert (it may end in tool calls again) pins its path
    tree.insert(agent, [], CTX, [1, 2, 3, 4, 7, 8, 9, 10], _cache(8), pin_s=30.0, parts_at=7)
    _flood(tree, 6, tag="more")
    assert _held(tree, agent, [1, 2, 3, 4, 7, 8, 9, 10, 0]) == 8
    assert tree.stats().nbytes <= _bytes(12)


def test_the_learned_ttl_follows_observed_gaps_within_bounds():
    latency = ToolLatency(max_s=60.0, default_s=10.0)
    assert latency.ttl() == 10.0  # before any gap
    for gap in [0.5 + 0.01 * i for i in range(100)]:  # 0.5 .. 1.49 s: p90 ~ 1.4
        latency.observe(gap)
    assert latency.ttl() == pytest.approx(1.4, abs=0.02)
    for _ in range(256):  # the window keeps the last 256: the old gaps are forgotten
        latency.observe(3.0)
    assert latency.ttl() == 3.0
    for _ in range(256):
        latency.observe(0.05)
    assert latency.ttl() == 1.0  # at least a second
    for _ in range(256):
        latency.observe(900.0)
    assert latency.ttl() == 60.0  # at most the server's max
    assert ToolLatency(max_s=0.0).ttl() == 0.0  # pins off
    assert ToolLatency(max_s=5.0, default_s=10.0).ttl() == 5.0
    with pytest.raises(ValueError):
        ToolLatency(max_s=-1.0)
    # through the tree: the time from a pinned answer to the next call on its path
    clock = _Clock()
    tree, agent = KVTree(10**6, clock=clock), TreeKey.of("agent")
    for step, gap in enumerate((2.0, 4.0, 3.0)):
        ids = list(range(1, 4 + 2 * step))
        tree.insert(agent, [], CTX, ids, _cache(len(ids)), pin_s=tree.latency.ttl(), parts_at=len(ids) - 1)
        clock.now += gap
        tree.match(agent, [*ids, 99, 98]).release()
    assert tree.stats().tool_gaps == 3 and tree.stats().retain_s == 4.0
    tree.match(agent, [1, 2, 3, 4, 5, 6, 7, 99]).release()  # a second match of the same answer: no new gap
    assert tree.stats().tool_gaps == 3


def test_a_tenant_cannot_pin_past_its_share():
    clock = _Clock()
    tree = KVTree(_bytes(12), tenant_share=0.5, clock=clock)
    alice = [TreeKey.of("alice", i, tenant="alice") for i in range(3)]
    for key in alice:  # the third pin would take her past half the budget: it is kept as any path
        tree.insert(key, [], CTX, [1, 2, 3], _cache(3), pin_s=30.0)
    assert tree.stats().pinned_bytes == _bytes(6)
    _flood(tree, 6, tag="bob", tenant="bob")
    assert [_held(tree, key, [1, 2, 3, 4]) for key in alice] == [3, 3, 0]
    assert tree.stats().nbytes <= _bytes(12)


# -- reuse through the engine: equal to computing the same request without the tree --

RUNS = [(Mode.FULL, "query", 1.0), (Mode.PREFIX, "query", 1.0), (Mode.REUSE, "query", 0.2),
        (Mode.BLEND, "query", 0.2), (Mode.BLEND, "query", 1.0), (Mode.BLEND, "deviation", 0.2),
        (Mode.FOCUS, "query", 0.2)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def engine(request, tmp_path_factory):
    family = request.param != "llama"  # qwen2 and gemma2 with sliding windows and their features on
    d = tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, family=family, seed=11)
    return Engine(load_model(str(d), device="cpu", dtype="float32"), tree=TreeConfig(256 << 20))


@pytest.mark.parametrize("mode,selector,ratio", RUNS, ids=[f"{m.value}-{s}-{r}" for m, s, r in RUNS])
def test_a_conversations_next_call_reuses_the_tree_and_equals_computing_it(engine, mode, selector, ratio):
    _next_call_equals_computing_it(engine, mode, selector, ratio)


@pytest.mark.parametrize("name", [n for n in sorted(FAMILY_CONFIGS) if n not in HYBRIDS])
def test_the_tree_is_exact_for_every_family(tmp_path_factory, name):
    """Every served family, its features on (tests/engine/test_families.py's configs), blend 0.2.
    Not hybrids: their tree is off (tests/engine/test_families.py)."""
    d = tiny_model_dir(tmp_path_factory.mktemp(f"tree-{name}"), name, family=True, initializer_range=0.2, seed=5)
    eng = Engine(load_model(str(d), device="cpu", dtype="float32"), tree=TreeConfig(64 << 20))
    _next_call_equals_computing_it(eng, Mode.BLEND, "query", 0.2)


def _next_call_equals_computing_it(eng: Engine, mode: Mode, selector: str, ratio: float) -> None:
    """Call 1 is computed, answered and remembered; call 2 (call 1's prompt, its answer, a
    tool turn, choosing by call 1's question) from the tree equals call 2 computed whole."""
    fmt = eng.prompt
    prefix_ids = fmt.prefix_ids()
    chunk_ids = [fmt.chunk_ids(c) for c in CHUNKS]
    opts = BlendOptions(recompute_ratio=ratio, selector=selector, focus=FocusOptions(handover=True, spread=0.0))
    kvs = [eng.prefill(prefix_ids, ids) for ids in chunk_ids]
    first_q = fmt.question_ids(QUESTION)
    trees = eng.conversations
    first = trees.lease(mode, prefix_ids, chunk_ids, CHUNKS, first_q, options=opts)
    assert first is not None and first.lease is None  # the tree is empty: its place, no lease

    res = eng.run(Prompt(first_q, prefix_ids, chunk_ids, kvs), mode, opts, reserve_tokens=16)
    stream = eng.decode(res, SamplingParams(max_new_tokens=5))
    list(stream)
    assert trees.remember(first, mode, res, len(first_q), len(prefix_ids), stream.token_ids) > 0

    second_q = [*first_q, *stream.token_ids[:4], *fmt.chunk_ids(TOOL_TURN)]
    alone = eng.run(Prompt(second_q, prefix_ids, chunk_ids, kvs, first_q), mode, opts, reserve_tokens=16)
    spot = trees.lease(mode, prefix_ids, chunk_ids, CHUNKS, second_q, options=opts, select_ids=first_q)
    assert spot is not None and spot.key == first.key and spot.lease is not None
    lease = spot.lease
    context = res.n_prompt_tokens - len(first_q) if mode not in (Mode.FULL, Mode.PREFIX) else 0
    assert lease.tokens >= context + len(first_q) + len(stream.token_ids[:4]) - 1 - (
        len(prefix_ids) if mode is Mode.PREFIX else 0)
    reused = eng.run(Prompt(second_q, prefix_ids, chunk_ids, None), mode, opts, reserve_tokens=16, resume=spot)

    assert torch.equal(reused.token_ids, alone.token_ids)
    diff = (reused.logits - alone.logits).abs().max().item()
    assert diff <= 1e-4, f"{mode.value}: logits with the tree differ by {diff:.3g}"
    n = alone.n_prompt_tokens
    assert (reused.cache.k[:, :, :n] - alone.cache.k[:, :, :n]).abs().max().item() <= 1e-4
    assert reused.used_chunks == alone.used_chunks and reused.handed_over == alone.handed_over
    assert reused.cached_tokens >= lease.tokens > alone.cached_tokens
    a, b = eng.decode(reused, SamplingParams(max_new_tokens=6)), eng.decode(alone, SamplingParams(max_new_tokens=6))
    assert "".join(a) == "".join(b)


def test_select_ids_equal_to_the_question_change_nothing(engine):
    """A single call chooses by its own question: passing it as select_ids is today's pass."""
    fmt = engine.prompt
    prefix_ids, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids(c) for c in CHUNKS]
    kvs, q = [engine.prefill(prefix_ids, ids) for ids in chunk_ids], fmt.question_ids(QUESTION)
    for mode in (Mode.BLEND, Mode.FOCUS):
        opts = BlendOptions(recompute_ratio=0.2)
        base = engine.run(Prompt(q, prefix_ids, chunk_ids, kvs), mode, opts)
        same = engine.run(Prompt(q, prefix_ids, chunk_ids, kvs, q), mode, opts)
        assert torch.equal(base.logits, same.logits) and torch.equal(base.recomputed, same.recomputed)


@pytest.mark.parametrize("name, header", [*((n, 0) for n in sorted(HYBRIDS)), ("qwen3_next", 3)])
def test_a_hybrids_next_call_resumes_from_the_state_where_its_prompt_ended(tmp_path_factory, name, header):
    """A hybrid's tree keeps its recurrent state where call 1's prompt ended (or `header` tokens
    before, where the answer's header starts: `Prompt.snapshot_at`, the pass stopping there
    on each recurrent layer): call 2 (call 1's prompt, part of its answer, a tool turn)
    resumes there, not at the deepest matched token (whose state is not held), and equals
    call 2 computed whole."""
    d = tiny_model_dir(tmp_path_factory.mktemp(f"tree-{name}"), name, family=True, initializer_range=0.2, seed=5)
    eng = Engine(load_model(str(d), device="cpu", dtype="float32"), tree=TreeConfig(64 << 20))
    trees = eng.conversations
    assert trees.enabled and trees.tree.recurrent
    fmt = eng.prompt
    first = [*fmt.prefix_ids(), *fmt.chunk_ids(CHUNKS[0]), *fmt.question_ids(QUESTION)]
    place = trees.lease(Mode.FULL, (), [], (), first)
    mark = len(first) - header
    res = eng.run(Prompt(first, snapshot_at=mark if header else None), Mode.FULL, reserve_tokens=16)
    assert (res.logits - eng.run(Prompt(first), Mode.FULL).logits).abs().max().item() <= 1e-4  # the stop is exact
    snapshot = trees.snapshot(res)
    assert snapshot is not None and snapshot.tokens == mark and snapshot.nbytes > 0
    stream = eng.decode(res, SamplingParams(max_new_tokens=5))
    list(stream)
    assert trees.remember(place, Mode.FULL, res, len(first), 0, stream.token_ids, snapshot) > 0

    second = [*first, *stream.token_ids[:4], *fmt.chunk_ids(TOOL_TURN)]
    alone = eng.run(Prompt(second), Mode.FULL, reserve_tokens=16)
    spot = trees.lease(Mode.FULL, (), [], (), second)
    assert spot.lease is not None and spot.tokens == mark  # the answer's KV is held, its state is not
    reused = eng.run(Prompt(second), Mode.FULL, reserve_tokens=16, resume=spot)
    assert torch.equal(reused.token_ids, alone.token_ids) and reused.cached_tokens == mark
    diff = (reused.logits - alone.logits).abs().max().item()
    assert diff <= 1e-4, f"logits with the tree differ by {diff:.3g}"
    a, b = eng.decode(reused, SamplingParams(max_new_tokens=6)), eng.decode(alone, SamplingParams(max_new_tokens=6))
    assert "".join(a) == "".join(b)
    # the snapshot was copied into the pass, not handed over: the tree's is untouched by it
    again = eng.run(Prompt(second), Mode.FULL, reserve_tokens=16, resume=trees.lease(Mode.FULL, (), [], (), second))
    assert (again.logits - alone.logits).abs().max().item() <= 1e-4


def test_a_hybrids_tree_without_a_held_state_matches_nothing(tmp_path_factory):
    """KV without the recurrent state after it is of no use to a hybrid: no lease."""
    d = tiny_model_dir(tmp_path_factory.mktemp("tree-qwen3-next"), "qwen3_next", family=True, seed=5)
    eng = Engine(load_model(str(d), device="cpu", dtype="float32"), tree=TreeConfig(64 << 20))
    ids = [*eng.prompt.prefix_ids(), *eng.prompt.question_ids(QUESTION)]
    res = eng.run(Prompt(ids), Mode.FULL, reserve_tokens=4)
    trees = eng.conversations
    assert trees.remember(trees.lease(Mode.FULL, (), [], (), ids), Mode.FULL, res, len(ids), 0) > 0  # no snapshot
    assert trees.lease(Mode.FULL, (), [], (), [*ids, 7, 8]).lease is None


def test_a_key_rotating_its_salt_is_held_to_its_one_share():
    """Salts keep one key's conversations apart (`TreeKey.tenant`), but shares count per key
    (`TreeKey.owner`): a key sending a new cache_salt on every request still evicts only its own
    paths once past its share, never every other key's conversations."""
    tree = KVTree(_bytes(12), tenant_share=0.5)
    for i in range(2):
        tree.insert(TreeKey.of("bob", i, tenant="bob"), [], CTX, [i, 1, 2], _cache(3))
    for i in range(10):  # alice, a new salt each time
        tree.insert(TreeKey.of("alice", i, tenant=f"alice{SALT_SEP}salt-{i}"), [], CTX, [i, 1, 2], _cache(3))
    assert tree.tenant_bytes("alice") <= _bytes(6)
    for i in range(2):
        lease = tree.match(TreeKey.of("bob", i, tenant="bob"), [i, 1, 2, 3])
        assert lease is not None and lease.matched == 3
        lease.release()
    # the salts still keep her conversations apart: another salt's key never matches
    assert TreeKey.of("alice", 9, tenant=f"alice{SALT_SEP}salt-9") != TreeKey.of("alice", 9, tenant="alice")
    assert TreeKey.of("x", tenant=f"alice{SALT_SEP}s").owner == "alice" == TreeKey.of("x", tenant="alice").owner
