"""The KV tree's pool: nodes index one pair of tensors per tier, so a split or a match copies
no KV it need not, freed slots serve the next node, and admission gets memory back."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.pool import MIN_TOKENS, KVPool
from ragkv.engine.kv.tree import KVTree, TreeKey, TreeTier
from tests.engine.test_tree import CTX, _bytes, _cache


def _read(tree: KVTree, key: TreeKey, ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Tokens a match supplies and the K and V it writes ([L, Hkv, T, D])."""
    lease = tree.match(key, ids)
    assert lease is not None
    out = KVCache(2, 1, 3, lease.tokens + 4, torch.float32, torch.device("cpu"))
    n = lease.write_into(out)
    lease.release()
    return n, out.k[:, :, :n], out.v[:, :, :n]


def test_the_pool_hands_out_slots_reads_them_back_and_reuses_what_is_given_back():
    pool = KVPool(10**6)
    a, b = _cache(5, fill=1), _cache(3, fill=50)
    sa = pool.put(a.k[:, :, :5], a.v[:, :, :5])
    sb = pool.put(b.k[:, :, :3], b.v[:, :, :3])
    assert pool.used == 8 and pool.capacity == MIN_TOKENS
    assert torch.equal(pool.get(sb)[0], b.k[:, :, :3]) and torch.equal(pool.get(sa)[1], a.v[:, :, :5])
    pool.release(sa)
    sc = pool.put(b.k[:, :, :3], b.v[:, :, :3])  # the freed slots, lowest first
    assert set(sc.tolist()) <= set(sa.tolist()) and pool.capacity == MIN_TOKENS
    with pytest.raises(ValueError, match="one tree serves one model"):
        pool.put(torch.zeros(3, 1, 2, 3), torch.zeros(3, 1, 2, 3))


def test_the_pool_grows_within_its_budget_and_compacts_to_what_it_holds():
    token = _bytes(1)
    pool = KVPool(600 * token)
    many = _cache(400, fill=0)
    s1 = pool.put(many.k[:, :, :300], many.v[:, :, :300])
    s2 = pool.put(many.k[:, :, 300:400], many.v[:, :, 300:400])
    assert pool.capacity <= 600 and pool.used == 400
    with pytest.raises(MemoryError):
        pool.put(many.k[:, :, :300], many.v[:, :, :300])  # past the budget: the tree never asks
    pool.release(s1)
    remap = pool.compact(0)
    assert remap is not None and pool.capacity == 100 and pool.nbytes == 100 * token
    assert torch.equal(pool.get(remap[s2])[0], many.k[:, :, 300:400])  # the held KV, renumbered


def test_a_split_moves_no_kv_and_both_halves_still_read_their_own():
    tree, key = KVTree(10**6), TreeKey.of("ctx")
    tree.insert(key, [9], CTX, [1, 2, 3, 4, 5, 6], _cache(7))
    pool = tree._pools[TreeTier.DEVICE]
    storage, used = pool.k.data_ptr(), pool.used
    assert tree.insert(key, [9], CTX, [1, 2, 3, 7, 8], _cache(6, fill=100)) == 2  # splits after 1, 2, 3
    assert pool.k.data_ptr() == storage and pool.used == used + 2  # only the new branch's 2 tokens were written
    n, k, v = _read(tree, key, [1, 2, 3, 4, 5, 6, 0])
    assert n == 7 and torch.equal(k, _cache(7).k[:, :, :7]) and torch.equal(v, _cache(7).v[:, :, :7])
    n, k, _ = _read(tree, key, [1, 2, 3, 7, 8, 0])
    assert n == 6 and k[0, 0, 4, 0].item() == 104 and k[0, 0, 2, 0].item() == 2


def test_evicted_nodes_give_their_slots_to_the_next_and_the_pool_stays_within_the_budget():
    tree = KVTree(_bytes(8))
    for i in range(20):
        tree.insert(TreeKey.of(i), [], CTX, [1, 2, 3], _cache(3, fill=i))
    pool = tree._pools[TreeTier.DEVICE]
    assert pool.capacity == 8 and tree.nbytes <= _bytes(8)  # never more memory than the budget
    n, k, _ = _read(tree, TreeKey.of(19), [1, 2, 3, 0])
    assert n == 3 and torch.equal(k, _cache(3, fill=19).k[:, :, :3])


def test_shrink_gives_the_pool_memory_back_and_a_lease_follows_its_slots():
    tree = KVTree(10**6)
    keys = [TreeKey.of(i) for i in range(4)]
    for i, key in enumerate(keys):
        tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4, fill=10 * i))
    held = tree.match(keys[3], [1, 2, 3, 4, 0])  # the newest, leased: it stays and its slots move
    assert tree.nbytes > _bytes(16)  # the pool took MIN_TOKENS slots
    assert tree.shrink(_bytes(4)) == _bytes(4) == tree.nbytes
    assert tree.stats().pool_bytes == _bytes(4)
    out = KVCache(2, 1, 3, 8, torch.float32, torch.device("cpu"))
    held.write_into(out)
    held.release()
    assert torch.equal(out.k[:, :, :4], _cache(4, fill=30).k[:, :, :4])
    tree.insert(keys[0], [], CTX, [1, 2, 3, 4], _cache(4, fill=5))  # the pool grows again
    assert torch.equal(_read(tree, keys[0], [1, 2, 3, 4, 0])[1], _cache(4, fill=5).k[:, :, :4])


def test_spilled_nodes_move_between_the_two_pools_and_free_their_device_slots():
    tree = KVTree(_bytes(4), host_bytes=_bytes(100))
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4, fill=1))
    tree.insert(b, [], CTX, [5, 6, 7, 8], _cache(4, fill=2))  # a goes down to the host pool
    device, host = tree._pools[TreeTier.DEVICE], tree._pools[TreeTier.HOST]
    assert device.used == 4 and host.used == 4 and host.k.device.type == "cpu"
    n, k, v = _read(tree, a, [1, 2, 3, 4, 0])
    assert n == 4 and torch.equal(k, _cache(4, fill=1).k[:, :, :4]) and torch.equal(v, _cache(4, fill=1).v[:, :, :4])
    tree.clear()
    assert device.capacity == host.capacity == 0 and tree.nbytes == 0


def test_a_lease_copies_its_path_into_the_request_once_with_no_gather():
    """Issue 70: a lease of device-held nodes writes their KV straight from the pool's tensors into
    the request's cache (one copy), where it went through a gathered copy first (two). Nodes whose
    slots are scattered (a pool fragmented by evictions) are still read right, through a gather."""
    tree = KVTree(10**6)
    key = TreeKey.of("conv")
    tree.insert(key, [], CTX, [1, 2, 3, 4, 5, 6], _cache(6, fill=3))
    tree.insert(key, [], CTX, [1, 2, 3, 4, 5, 6, 7, 8, 9], _cache(9, fill=3))  # a second node below the first
    pool = tree._pools[TreeTier.DEVICE]
    n, k, v = _read(tree, key, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0])
    assert n == 9 and torch.equal(k, _cache(9, fill=3).k[:, :, :9]) and torch.equal(v, _cache(9, fill=3).v[:, :, :9])
    assert pool.gathered_tokens == 0  # no token went through a gather on its way to the request

    scattered = KVPool(10**6)  # slots 0, 2, 4: not one run
    c = _cache(6, fill=7)
    slots = scattered.put(c.k[:, :, :6], c.v[:, :, :6])
    scattered.release(slots[1::2])
    k_out, v_out = torch.empty_like(c.k[:, :, :3]), torch.empty_like(c.v[:, :, :3])
    scattered.copy_into(slots[0::2], k_out, v_out)
    assert torch.equal(k_out, c.k[:, :, 0:6:2]) and torch.equal(v_out, c.v[:, :, 0:6:2])
    assert scattered.gathered_tokens == 3


def test_slot_indices_live_on_the_host_so_a_lease_never_reads_the_device():
    """Issue 70: a lease tells whether a node's slots are one run by reading their indices; were
    they on the pool's device (a GPU), each read would wait for every kernel queued before it. A
    pool on the meta device holds no values at all: putting, copying a run and gathering scattered
    slots all work there only if no slot index is read from the device."""
    pool = KVPool(10**6, device="meta")
    c = _cache(6, fill=2)
    slots = pool.put(c.k[:, :, :6], c.v[:, :, :6])
    assert slots.device.type == "cpu" and pool.k.device.type == "meta"
    k_out, v_out = torch.empty_like(c.k[:, :, :6], device="meta"), torch.empty_like(c.v[:, :, :6], device="meta")
    pool.copy_into(slots, k_out, v_out)  # one run: a slice of the pool
    assert pool.gathered_tokens == 0
    pool.copy_into(slots[0::2], k_out[:, :, :3], v_out[:, :, :3])  # scattered: a gather
    assert pool.gathered_tokens == 3
    pool.release(slots[1::2])
    remap = pool.compact(0)
    assert remap is not None and remap.device.type == "cpu" and remap[slots[0::2]].tolist() == [0, 1, 2]


def test_a_pool_first_written_under_inference_mode_takes_writes_from_outside_it() -> None:
    """The host tier's pool may first be written under inference mode (a prompt pass makes room in
    the decode pool, and the tree spills there: `KVTree._reclaim`); admission's shrink writes to it
    later from another thread, outside inference mode. Its tensors are plain ones, so that write
    works (before: "Inplace update to inference tensor outside InferenceMode", an INTERNAL error)."""
    pool = KVPool(_bytes(64), "cpu")
    with torch.inference_mode():
        first = pool.put(torch.ones(2, 1, 4, 3), torch.ones(2, 1, 4, 3))
    assert not pool.k.is_inference()
    later = pool.put(torch.full((2, 1, 40, 3), 2.0), torch.full((2, 1, 40, 3), 2.0))  # grows, outside it
    k, _ = pool.get(torch.cat([first, later]))
    assert torch.equal(k[:, :, :4], torch.ones(2, 1, 4, 3)) and torch.equal(k[:, :, 4:], torch.full((2, 1, 40, 3), 2.0))


def test_a_spill_whose_host_write_fails_leaves_the_node_where_it_was(monkeypatch) -> None:
    """A node moving to the host tier is written there before its device slots go: when that write
    raises, the node is still on the device with its KV, not a device node with no slots (which
    failed every later read of it: "holds no slots: a bug")."""
    tree = KVTree(_bytes(8), host_bytes=_bytes(100))
    key = TreeKey.of("a")
    tree.insert(key, [7], CTX, [1, 2, 3, 4], _cache(5, fill=10))
    node = tree._roots[key].children[1]

    def broken(*args, **kwargs):
        raise RuntimeError("the host write failed")

    monkeypatch.setattr(tree._pools[TreeTier.HOST], "put", broken)
    with pytest.raises(RuntimeError, match="host write failed"):
        tree.shrink(0)
    assert node.tier is TreeTier.DEVICE and node.slots is not None
    monkeypatch.undo()
    lease = tree.match(key, [1, 2, 3, 4, 0])
    out = KVCache(2, 1, 3, 8, torch.float32, torch.device("cpu"))
    assert lease.write_into(out) == 5 and torch.equal(out.k[:, :, :5], _cache(5, fill=10).k[:, :, :5])
    lease.release()


def test_a_lease_collected_while_its_thread_holds_the_tree_lets_go_later_without_a_deadlock() -> None:
    """A lease dropped unreleased is let go by its finalizer, which the collector runs in whatever
    thread allocates: here one holding the tree's lock (as admission's shrink holds it walking
    the tree). It gives its references back when the lock is next taken (before, it took the
    lock again and that thread waited forever, with every call behind it: DEADLINE_EXCEEDED)."""
    import threading

    tree = KVTree(_bytes(100))
    key = TreeKey.of("a")
    tree.insert(key, [7], CTX, [1, 2, 3, 4], _cache(5))
    node = tree._roots[key].children[1]
    held = [tree.match(key, [1, 2, 3, 4, 0])]
    assert node.refs == 1
    done = threading.Event()

    def drop_under_the_lock() -> None:
        with tree._lock:
            held.clear()  # the last reference: its finalizer runs here
        done.set()

    worker = threading.Thread(target=drop_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "the finalizer waited for the lock its own thread held"
    assert tree.match(key, [1, 2, 3, 4, 0]) is not None  # takes the lock: the dropped lease let go first
    assert node.refs == 1  # the new match's, the dropped one's gone
