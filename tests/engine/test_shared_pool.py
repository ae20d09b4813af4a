"""The KV tree's device tier as a share of the decode pool (engine/kv/decode_pool.py `SharedSlots`):
an insert takes a request's KV where it lies, a lease lends its path in place, and under pressure
the pool stays within itself with every lease reading what was kept (issue 70)."""

from __future__ import annotations

import random

import pytest
import torch

from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.decode_pool import DecodePool, DecodePoolFullError, Run
from ragkv.engine.kv.tree import KVTree, TreeKey, TreeTier
from tests.engine.test_tree import CTX, _bytes


def _shared(capacity: int, tree_tokens: int) -> tuple[DecodePool, KVTree]:
    pool = DecodePool(2, 1, 3, capacity_tokens=capacity, dtype=torch.float32, device="cpu")
    return pool, KVTree(_bytes(tree_tokens), device_pool=pool.share(_bytes(tree_tokens)))


def _write(cache: KVCache, ids: list[int], start: int = 0) -> None:
    """What a prompt pass would leave: K of position j is ids[j] (V its negative), from `start` on."""
    values = torch.tensor(ids[start:], dtype=torch.float32)[None, None, :, None]  # [1, 1, T, 1]
    cache.k[:, :, start:len(ids)] = values
    cache.v[:, :, start:len(ids)] = -values
    cache.length = len(ids)


def _holds(cache: KVCache, ids: list[int]) -> bool:
    want = torch.tensor(ids, dtype=torch.float32)[None, None, :, None].expand(2, 1, len(ids), 3)
    return torch.equal(cache.k[:, :, :len(ids)], want) and torch.equal(cache.v[:, :, :len(ids)], -want)


def test_an_insert_takes_the_requests_kv_where_it_lies_and_the_next_call_runs_on_from_it_in_place() -> None:
    pool, tree = _shared(512, 128)
    shared = tree._pools[TreeTier.DEVICE]
    key, ctx, turn = TreeKey.of("conv"), [7, 8], [1, 2, 3, 4, 5, 6, 7, 8]
    first = pool.new_cache(16)
    _write(first, ctx + turn)
    run = pool.run_of(first)
    tree.insert(key, ctx, CTX, turn, first)
    assert pool.handed_tokens == 10 and shared.written_tokens == 0  # nothing copied into the tree
    assert tree._roots[key].slots.tolist() == [run.start, run.start + 1]  # the context where the request left it
    pool.release(first)
    assert pool.used == pool.tree_tokens == 10  # the run gave back all but what the tree took

    lease = tree.match(key, turn + [9, 10])
    assert lease is not None and lease.tokens == 10
    nxt = lease.lend(24)
    assert nxt is not None
    assert nxt.k.data_ptr() == pool.k[:, :, run.start:].data_ptr()  # the tree's own slots, not a copy
    assert _holds(nxt, ctx + turn) and shared.read_tokens == 0 and pool.borrowed_tokens == 10
    assert tree._roots[key].refs == 1  # the lease lasts the request
    _write(nxt, ctx + turn + [9, 10, 11], start=10)  # the new call's own tokens, after the path
    tree.insert(key, ctx, CTX, turn + [9, 10, 11], nxt)
    assert pool.handed_tokens == 13 and shared.written_tokens == 0
    pool.release(nxt)
    assert tree._roots[key].refs == 0 and pool.used == pool.tree_tokens == 13
    again = tree.match(key, turn + [9, 10, 11, 12])
    out = KVCache(2, 1, 3, 16, torch.float32, torch.device("cpu"))
    assert again.write_into(out) == 13 and _holds(out, ctx + turn + [9, 10, 11])
    again.release()


def test_a_match_that_ends_inside_a_node_moves_the_rest_out_of_the_way_and_keeps_it() -> None:
    pool, tree = _shared(512, 128)
    key, answer = TreeKey.of("conv"), [1, 2, 3, 4, 5, 6, 7, 8]
    req = pool.new_cache(16)
    _write(req, answer)
    tree.insert(key, [], CTX, answer, req)
    pool.release(req)
    other = tree.match(key, [1, 2, 3, 4, 50, 51])  # a second lease on the same node: it cannot be cut
    lease = tree.match(key, [1, 2, 3, 4, 60, 61])
    assert lease.lend(16) is None and pool.relocated_tokens == 0  # the caller copies the path instead
    other.release()
    nxt = lease.lend(16)
    assert nxt is not None and pool.relocated_tokens == 4  # [5, 6, 7, 8] moved; the cut path lent in place
    assert _holds(nxt, [1, 2, 3, 4])
    _write(nxt, [1, 2, 3, 4, 60, 61, 62], start=4)
    pool.release(nxt)
    full = tree.match(key, answer + [0])  # the earlier answer is still there, moved, as it was
    out = KVCache(2, 1, 3, 16, torch.float32, torch.device("cpu"))
    assert full.write_into(out) == 8 and _holds(out, answer)
    full.release()


def _run_at(pool: DecodePool, start: int, size: int) -> KVCache:
    """A request's run at slots [start, start + size) (free now): where another call's run may lie."""
    with pool._lock:
        f = next(f for f in pool._free if f.start <= start and start + size <= f.start + f.size)
        pool._carve(f, start, start + size)
        return pool._cache(Run(start, size))


def _conversations(tree: KVTree, pool: DecodePool, n: int, tokens: int) -> list[list[int]]:
    """`n` conversations of `tokens` tokens each kept by the tree, inserted from requests that then ended."""
    out = []
    for i in range(n):
        out.append([1000 * (i + 1) + j for j in range(tokens)])
        _kept(pool, tree, TreeKey.of(f"c{i}"), out[-1])
    return out


def _kept(pool: DecodePool, tree: KVTree, key: TreeKey, ids: list[int]) -> int:
    """A conversation's first call `ids` kept by the tree, inserted from a request that then ended:
    the slot after its path."""
    req = pool.new_cache(len(ids))
    _write(req, ids)
    tree.insert(key, [], CTX, ids, req)
    pool.release(req, keep=False)
    return int(tree._roots[key].children[ids[0]].slots[-1]) + 1


def test_a_request_takes_the_room_the_tree_does_not_hold() -> None:
    """The tree's budget is a cap, not a reservation: with the tree empty a request may take
    the whole pool (before, runs stopped at the pool less the tree's budget, and admission let
    in requests that then decoded outside the pool, past --kv-budget-bytes)."""
    pool, tree = _shared(512, 384)
    assert pool.capacity == 496
    big = pool.new_cache(400)
    assert big is not None and pool.run_of(big).size == 400
    _write(big, list(range(400)))
    assert _holds(big, list(range(400)))
    pool.release(big, keep=False)
    assert pool.free_tokens == pool.capacity


def test_a_path_copied_for_a_call_is_kept_where_the_copy_lies_so_the_next_call_runs_on_from_it() -> None:
    """A conversation's path has a request's run right after it, so its next call cannot run on
    from it: the path is copied into the call's run. At the insert after the answer the tree keeps
    the path's nodes in that copy and gives its old slots back (`rehome`: no KV moves), so the
    path lies in one run again and the call after is lent in place (before, the path stayed
    split between two places and every later call copied it)."""
    pool, tree = _shared(1024, 512)
    key, turn = TreeKey.of("conv"), list(range(1, 65))
    after = _run_at(pool, _kept(pool, tree, key, turn), 16)  # another agent's call right after the path

    second = turn + list(range(100, 120))
    lease = tree.match(key, second + [0])
    assert lease.lend(len(second) + 8) is None  # no room after the path: copied
    cache = pool.new_cache(len(second) + 8)
    cache.from_tree = lease.write_into(cache)
    lease.release()
    _write(cache, second, start=64)
    written = tree._pools[TreeTier.DEVICE].written_tokens
    tree.insert(key, [], CTX, second, cache)
    run = pool.run_of(cache)
    node = tree._roots[key].children[1]
    assert node.slots.tolist() == list(range(run.start, run.start + 64))  # kept in the call's copy
    assert pool.rehomed_tokens == 64 and tree._pools[TreeTier.DEVICE].written_tokens == written
    assert pool.tree_tokens == 84  # the old 64 slots went back: the tree holds the path once
    pool.release(cache, keep=False)
    pool.release(after, keep=False)

    third = second + [7, 8, 9]
    lease = tree.match(key, third + [0])
    nxt = lease.lend(len(third) + 8)
    assert nxt is not None and nxt.k.data_ptr() == pool.k[:, :, run.start:].data_ptr()  # lent in place
    assert _holds(nxt, second)
    pool.release(nxt, keep=False)


def test_a_path_with_room_for_its_prompt_but_not_its_whole_reserve_is_lent_in_place() -> None:
    """Free slots after a path hold the next call's prompt but not the decode room it asks for:
    the call still runs on from the path in place, in a shorter run its decode grows (before,
    the whole path was copied for want of room that the answer may never use)."""
    pool, tree = _shared(1024, 512)
    key, turn = TreeKey.of("conv"), list(range(1, 65))
    after = _run_at(pool, _kept(pool, tree, key, turn) + 32, 16)  # 32 free slots after the path, then a run
    second = turn + list(range(100, 120))  # 20 new tokens: fits in 32, its 256 of decode room do not
    lease = tree.match(key, second + [0])
    assert lease.lend(len(second) + 256) is None  # all of it asked: not there
    nxt = lease.lend(len(second) + 256, least=len(second) + 1)
    assert nxt is not None and nxt.capacity == 96 and pool.borrowed_tokens == 64
    assert _holds(nxt, turn)
    pool.release(nxt, keep=False)
    pool.release(after, keep=False)


def test_a_lent_run_that_moves_to_grow_leaves_the_path_in_one_run_at_the_insert() -> None:
    """A call lent its path in a short run (room for its prompt) grows past the free slots after
    it: the run moves, copying the path and letting its lease go. The insert after the answer
    keeps the path in that copy (`rehome`), so the path and the new turn lie in one run and
    the next call is lent in place."""
    pool, tree = _shared(1024, 512)
    key, turn = TreeKey.of("conv"), list(range(1, 65))
    after = _run_at(pool, _kept(pool, tree, key, turn) + 32, 16)
    second = turn + list(range(100, 120))
    lease = tree.match(key, second + [0])
    cache = lease.lend(len(second) + 256, least=len(second) + 1)
    assert cache is not None and pool.run_of(cache).borrowed == 64
    _write(cache, second, start=64)
    pool.grow(cache, len(second) + 100)  # the answer outgrows the 32 free slots: a move
    assert pool.moves == 1 and tree._roots[key].children[1].refs == 0  # the lease let go
    answer = second + list(range(200, 260))
    _write(cache, answer, start=len(second))
    tree.insert(key, [], CTX, answer, cache)
    run = pool.run_of(cache)
    assert tree._roots[key].children[1].slots.tolist() == list(range(run.start, run.start + 64))
    assert pool.rehomed_tokens == 64
    pool.release(cache, keep=False)
    pool.release(after, keep=False)
    nxt = tree.match(key, answer + [0]).lend(len(answer) + 8)
    assert nxt is not None and _holds(nxt, answer)
    pool.release(nxt, keep=False)


def test_a_tree_budget_past_the_pool_is_held_to_the_pool_and_requests_still_come_first() -> None:
    """`--kv-tree-bytes` past `--kv-budget-bytes` (the pool): the tree may fill the pool, not
    more (before, the engine allocated the tree's budget beside the pool, past the KV budget),
    and a request still gets its run: the tree moves nodes out of its way."""
    pool = DecodePool(2, 1, 3, capacity_tokens=512, dtype=torch.float32, device="cpu")
    tree = KVTree(_bytes(4096), host_bytes=_bytes(4096), device_pool=pool.share(_bytes(4096)))
    assert pool.tree_room == pool.capacity == 496
    convs = _conversations(tree, pool, 7, 64)  # 448 of the 496 slots
    assert pool.tree_tokens == 448
    req = pool.new_cache(200)
    assert req is not None and pool.reclaimed_tokens >= 152
    for i, ids in enumerate(convs):
        lease = tree.match(TreeKey.of(f"c{i}"), ids + [0])
        out = KVCache(2, 1, 3, 64, torch.float32, torch.device("cpu"))
        assert lease.write_into(out) == 64 and _holds(out, ids), f"conversation {i} lost its KV"
        lease.release()


def test_a_request_that_finds_no_room_has_the_tree_move_its_unleased_nodes_down_and_keep_them() -> None:
    """The tree holds 5 conversations of 64 tokens (320 of the pool's 496 slots), one of them
    leased by a call in flight. A request of 256 tokens finds no free range that large: the
    tree moves the unleased nodes in the way to its host tier (`reclaim`), never the leased
    one, and the request runs in the pool. Every conversation is still matched, with its KV."""
    pool = DecodePool(2, 1, 3, capacity_tokens=512, dtype=torch.float32, device="cpu")
    tree = KVTree(_bytes(384), host_bytes=_bytes(1024), device_pool=pool.share(_bytes(384)))
    convs = _conversations(tree, pool, 5, 64)
    assert pool.tree_tokens == 320 and pool.free_tokens == 176
    leased = tree.match(TreeKey.of("c2"), convs[2] + [0])
    leased_slots = tree._roots[TreeKey.of("c2")].children[convs[2][0]].slots.clone()

    req = pool.new_cache(256)
    assert req is not None, "the request decodes outside the pool"
    assert pool.reclaimed_tokens > 0 and pool.tree_tokens == 320 - pool.reclaimed_tokens
    a, b = pool.run_of(req).start, pool.run_of(req).start + 256
    on_host = [i for i in range(5) if tree._roots[TreeKey.of(f"c{i}")].children[convs[i][0]].tier is TreeTier.HOST]
    assert on_host and 2 not in on_host  # moved down, the leased one kept where its call reads it
    assert torch.equal(tree._roots[TreeKey.of("c2")].children[convs[2][0]].slots, leased_slots)
    assert not ((leased_slots >= a) & (leased_slots < b)).any()
    _write(req, list(range(256)))
    leased.release()
    for i, ids in enumerate(convs):
        lease = tree.match(TreeKey.of(f"c{i}"), ids + [0])
        out = KVCache(2, 1, 3, 64, torch.float32, torch.device("cpu"))
        assert lease.write_into(out) == 64 and _holds(out, ids), f"conversation {i} lost its KV"
        lease.release()
    assert _holds(req, list(range(256)))


def test_leased_paths_in_the_way_leave_a_request_outside_the_pool() -> None:
    """Every conversation leased: nothing may move, so a request that finds no room gets no run
    (it decodes ragged, as before) and every path stays where its call reads it."""
    pool = DecodePool(2, 1, 3, capacity_tokens=512, dtype=torch.float32, device="cpu")
    tree = KVTree(_bytes(384), host_bytes=_bytes(1024), device_pool=pool.share(_bytes(384)))
    convs = _conversations(tree, pool, 5, 64)
    leases = [tree.match(TreeKey.of(f"c{i}"), ids + [0]) for i, ids in enumerate(convs)]
    assert pool.new_cache(256) is None and pool.reclaimed_tokens == 0 and pool.tree_tokens == 320
    for lease in leases:
        lease.release()


def test_the_tree_keeps_new_nodes_on_the_device_only_in_free_slots() -> None:
    """Requests hold all but 32 slots of the pool; a conversation of 64 tokens from a cache of its
    own (not in the pool: nothing to take in place) goes to the host tier, not into slots a run
    holds (before, the tree's share was kept apart, so this raised)."""
    pool = DecodePool(2, 1, 3, capacity_tokens=512, dtype=torch.float32, device="cpu")
    tree = KVTree(_bytes(384), host_bytes=_bytes(1024), device_pool=pool.share(_bytes(384)))
    runs = [pool.new_cache(464)]
    assert runs[0] is not None and pool.free_tokens == 32
    ids = list(range(1, 65))
    own = KVCache(2, 1, 3, 64, torch.float32, torch.device("cpu"))
    _write(own, ids)
    tree.insert(TreeKey.of("c"), [], CTX, ids, own)
    assert tree._roots[TreeKey.of("c")].children[1].tier is TreeTier.HOST and pool.tree_tokens == 0
    lease = tree.match(TreeKey.of("c"), ids + [0])
    out = KVCache(2, 1, 3, 64, torch.float32, torch.device("cpu"))
    assert lease.write_into(out) == 64 and _holds(out, ids)
    lease.release()


# 5 and 8 caught a tree evicting what a live request had handed it; requests of up to 400 tokens
# (of the pool's 1008 slots) press harder on the tree's room (`reclaim`); 38 caught a path lent in
# place whose middle lay elsewhere (its first and last slots as far apart as its length); with a host
# tier, 0 caught an insert's refill making host room from the node it was bringing back
@pytest.mark.parametrize(("seed", "largest", "host"), [(0, 96, 0), (5, 96, 0), (8, 96, 0), (0, 400, 0), (1, 400, 0),
                                                       (38, 400, 0), (0, 96, 256), (7, 400, 256)])
def test_twenty_conversations_through_a_small_shared_pool_stay_within_it_and_every_lease_reads_what_was_kept(
        seed: int, largest: int, host: int) -> None:
    """Issue 70's pool under pressure: 20 conversations, each call leasing its path (lent in place,
    or copied when it cannot be), requests in flight side by side, chunk-sized requests with no
    lease, answers that grow their runs, the tree shrunk by admission now and then, and requests
    that find no free range have the tree move its unleased nodes out of the way. After every call: the requests' runs, the tree's
    slots and the free list partition the pool exactly, the tree within its budget, and every
    request's KV (lent, copied or its own) is what its tokens wrote."""
    rng = random.Random(seed)
    pool = DecodePool(2, 1, 3, capacity_tokens=1024, dtype=torch.float32, device="cpu")
    tree = KVTree(_bytes(384), host_bytes=_bytes(host), device_pool=pool.share(_bytes(384)))
    shared = tree._pools[TreeTier.DEVICE]
    convs = {i: [100 * i + 1] for i in range(20)}  # each conversation's tokens so far
    live: list[tuple[KVCache, list[int]]] = []

    def check() -> None:
        owned = [set(range(a, b)) for c, _ in live if (r := pool.run_of(c)) is not None for a, b in r.own()]
        tree_slots = [set(n.slots.tolist()) for n in tree._all() if n.tier is TreeTier.DEVICE and n.slots is not None]
        free = [set(range(f.start, f.start + f.size)) for f in pool._free]
        parts = owned + tree_slots + free
        assert sum(len(p) for p in parts) == len(set().union(*parts)) == pool.capacity  # no slot twice, none lost
        assert pool.tree_tokens == sum(len(s) for s in tree_slots) <= pool.tree_room
        for cache, ids in live:
            assert _holds(cache, ids)

    for call in range(200):
        if rng.random() < 0.2:  # a chunk-sized request with no conversation
            cache = pool.new_cache(rng.randint(16, largest))
            if cache is not None:
                ids = [9000 + call] * min(cache.capacity, 40)
                _write(cache, ids)
                live.append((cache, ids))
        else:
            i = rng.randrange(20)
            base = convs[i]
            if rng.random() < 0.25 and len(base) > 2:  # a call that parts from the last answer before its end
                base = base[:len(base) - rng.randint(1, 2)]
            key, ids = TreeKey.of(f"conv{i}"), base + [100 * i + rng.randint(2, 99) for _ in range(rng.randint(1, 12))]
            lease = tree.match(key, ids[1:] + [0])
            held = 0 if lease is None else lease.tokens
            # as the engine's prompt pass: lent with room for the prompt at least, else copied (and marked so)
            cache = lease.lend(len(ids) + 8, least=len(ids) + 1) if lease is not None else None
            if cache is None:
                cache = pool.new_cache(len(ids) + 8) or KVCache(2, 1, 3, len(ids) + 8, torch.float32, torch.device("cpu"))
                if lease is not None:
                    cache.from_tree = lease.write_into(cache)
                    lease.release()
            assert _holds(cache, ids[:held])  # what the lease supplied is what was kept
            _write(cache, ids, start=held)
            answer = ids + [100 * i + rng.randint(2, 99) for _ in range(rng.randint(0, 24))]
            try:  # its decode grows the cache: in place, or a move
                cache.ensure(len(answer))
            except DecodePoolFullError:  # as the pooled decoder does: its KV leaves the pool, it decodes on
                pool.release(cache)
                cache.ensure(len(answer))
            _write(cache, answer, start=len(ids))
            ids = answer
            tree.insert(key, ids[:1], CTX, ids[1:], cache)
            convs[i] = ids
            live.append((cache, ids))
        while len(live) > 4 or (live and rng.random() < 0.3):  # requests end, oldest first
            pool.release(live.pop(0)[0])
        if call % 25 == 24:  # admission takes the tree's memory back
            tree.shrink(_bytes(rng.randint(0, 384)))
        check()
    assert pool.borrowed_tokens > 0 and pool.handed_tokens > 0 and pool.relocated_tokens > 0
    assert pool.reclaimed_tokens > 0  # runs found the tree in their way and had it give up room
    assert pool.rehomed_tokens > 0  # copied paths kept where the copies lay
    assert shared.read_tokens > 0  # some paths could not be lent (shared contexts, no room after): copied
    for cache, _ in live:
        pool.release(cache)
    tree.clear()
    assert pool.used == 0 and [(f.start, f.size) for f in pool._free] == [(0, pool.capacity)]


def test_a_pool_that_does_not_fit_the_device_says_which_settings_to_lower(monkeypatch) -> None:
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "zeros", oom)
    with pytest.raises(MemoryError, match=r"--kv-budget-bytes \(the KV tree's device tier within it\); lower it"):
        DecodePool(2, 1, 3, capacity_tokens=1 << 20, dtype=torch.float32, device="cpu")
