"""Priorities between conversations are the client's to give (`retain_priority`): lower
leaves a tier first, whatever its recency; above 0 holds only within the tenant's share."""

from __future__ import annotations

from ragkv.engine.kv.tree import KVTree, TreeKey
from tests.engine.test_tree import CTX, _bytes, _cache


def _held(tree: KVTree, key: TreeKey) -> int:
    """Tokens of `key`'s four-token path the tree still supplies."""
    lease = tree.match(key, [1, 2, 3, 4, 0])
    if lease is None:
        return 0
    lease.release()
    return lease.tokens


def test_a_higher_priority_conversation_outlives_more_recent_ones():
    tree = KVTree(_bytes(8))
    old, new, newest = TreeKey.of("old"), TreeKey.of("new"), TreeKey.of("newest")
    tree.insert(old, [], CTX, [1, 2, 3, 4], _cache(4), priority=5)
    tree.insert(new, [], CTX, [1, 2, 3, 4], _cache(4))
    tree.insert(newest, [], CTX, [1, 2, 3, 4], _cache(4))  # room for it: LRU would take `old`
    assert (_held(tree, old), _held(tree, new), _held(tree, newest)) == (4, 0, 4)


def test_below_zero_leaves_first_even_when_most_recent():
    tree = KVTree(_bytes(8))
    a, batch, c = TreeKey.of("a"), TreeKey.of("batch"), TreeKey.of("c")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4))
    tree.insert(batch, [], CTX, [1, 2, 3, 4], _cache(4), priority=-1)
    tree.insert(c, [], CTX, [1, 2, 3, 4], _cache(4))
    assert (_held(tree, a), _held(tree, batch), _held(tree, c)) == (4, 0, 4)


def test_a_conversations_latest_call_sets_its_priority():
    tree = KVTree(_bytes(8))
    a, b, c = TreeKey.of("a"), TreeKey.of("b"), TreeKey.of("c")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4), priority=9)
    tree.insert(b, [], CTX, [1, 2, 3, 4], _cache(4), priority=1)
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4), priority=0)  # its next call says it matters less now
    tree.insert(c, [], CTX, [1, 2, 3, 4], _cache(4), priority=1)
    assert (_held(tree, a), _held(tree, b), _held(tree, c)) == (0, 4, 4)


def test_a_tenant_giving_every_path_top_priority_cannot_hold_past_its_share():
    """alice marks every conversation 100; past half the tree they count as 0, so a third
    tenant's insert takes alice's older unprotected path before bob's, as plain LRU would."""
    tree = KVTree(_bytes(12), tenant_share=0.5)
    a1, a2 = TreeKey.of("a1", tenant="alice"), TreeKey.of("a2", tenant="alice")
    b1, c1 = TreeKey.of("b1", tenant="bob"), TreeKey.of("c1", tenant="carol")
    tree.insert(a1, [], CTX, [1, 2, 3, 4], _cache(4), priority=100)
    tree.insert(a2, [], CTX, [1, 2, 3, 4], _cache(4), priority=100)  # alice's share (6 tokens) is spent
    tree.insert(b1, [], CTX, [1, 2, 3, 4], _cache(4))
    tree.insert(c1, [], CTX, [1, 2, 3, 4], _cache(4))
    assert _held(tree, a1) == 4  # within her share, her priority holds
    assert _held(tree, b1) == 4 and _held(tree, c1) == 4
    assert _held(tree, a2) == 0  # past it: least recently used among the rest


def test_priority_orders_the_host_tier_too():
    tree = KVTree(_bytes(4), host_bytes=_bytes(8))
    keep, x, y, z = (TreeKey.of(n) for n in ("keep", "x", "y", "z"))
    tree.insert(keep, [], CTX, [1, 2, 3, 4], _cache(4), priority=3)
    tree.insert(x, [], CTX, [1, 2, 3, 4], _cache(4))  # keep goes down to the host
    tree.insert(y, [], CTX, [1, 2, 3, 4], _cache(4))  # x too: the host is full
    tree.insert(z, [], CTX, [1, 2, 3, 4], _cache(4))  # y goes down; the host makes room: LRU would take keep
    assert (_held(tree, keep), _held(tree, x), _held(tree, y), _held(tree, z)) == (4, 0, 4, 4)


def test_a_restarted_tree_keeps_each_paths_priority(tmp_path):
    from ragkv.kvstore.tree_files import TreeFiles

    def files() -> TreeFiles:
        return TreeFiles(tmp_path / "tree", "model-a", "tok-a")

    tree = KVTree(_bytes(100), files=files(), disk_bytes=_bytes(100))
    keep, other = TreeKey.of("keep"), TreeKey.of("other")
    tree.insert(keep, [9], CTX, [1, 2, 3, 4], _cache(5), priority=7)
    tree.insert(other, [9], CTX, [1, 2, 3, 4], _cache(5), priority=-3)
    assert tree.persist() == 4  # each context and its path
    again = KVTree(_bytes(100), files=files(), disk_bytes=_bytes(100))
    assert again.stats().restored == 4
    assert {(n.key, n.priority) for n in again._all()} == {(keep, 7), (other, -3)}
