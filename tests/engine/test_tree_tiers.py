"""The KV tree's tiers: conversations spilled to CPU memory and disk, read back exactly, and
found again by a new tree (a restarted server) over the same files."""

from __future__ import annotations

import torch

from ragkv.engine import BlendOptions, Engine, Prompt, SamplingParams, TreeConfig, load_model
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.tree import KVTree, TreeContext, TreeKey, TreeTier
from ragkv.evals.testing import tiny_model_dir
from ragkv.kvstore.tree_files import TreeFiles
from ragkv.types import Mode
from tests.engine.test_tree import _bytes, _cache
from tests.engine.test_tree_layered import restarted_conversation

CTX = TreeContext(prefix_tokens=1, chunk_end=2, chunk_tokens=1, used_chunks=(0,), chunk_scores=(0.5,))


def _read(tree: KVTree, key: TreeKey, ids: list[int]) -> tuple[int, int, torch.Tensor]:
    """(tokens supplied, of them spilled, K of the supplied slots) of a match, released."""
    lease = tree.match(key, ids)
    if lease is None:
        return 0, 0, torch.empty(0)
    out = KVCache(2, 1, 3, len(ids) + 8, torch.float32, torch.device("cpu"))
    lease.write_into(out)
    lease.release()
    return lease.tokens, lease.spilled, out.k[:, :, :lease.tokens].clone()


def _files(tmp_path) -> TreeFiles:
    return TreeFiles(tmp_path / "tree", "model-a", "tok-a")


def test_a_node_leaving_the_device_moves_to_host_and_reads_back_exactly():
    tree = KVTree(_bytes(8), host_bytes=_bytes(100))
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [7], CTX, [1, 2, 3, 4], _cache(5, fill=10))
    tree.insert(b, [8], CTX, [5, 6, 7, 8], _cache(5, fill=20))  # no room on the device: a spills
    stats = tree.stats()
    # a's question (4 tokens) moved; its context (1) still fits
    assert stats.nbytes <= _bytes(8) and stats.host_bytes == _bytes(4) and stats.evictions == 0
    tokens, spilled, k = _read(tree, a, [1, 2, 3, 4, 0])
    assert (tokens, spilled) == (5, 4)
    assert torch.equal(k, _cache(5, fill=10).k[:, :, :5])
    assert tree.stats().spilled_hit_tokens == 4


def test_without_lower_tiers_a_spilled_node_is_evicted_as_before():
    tree = KVTree(_bytes(8))
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [7], CTX, [1, 2, 3, 4], _cache(5))
    tree.insert(b, [8], CTX, [5, 6, 7, 8], _cache(5))
    tokens, spilled, _ = _read(tree, a, [1, 2, 3, 4, 0])
    assert (tokens, spilled) == (1, 0) and tree.stats().evictions == 1  # a's question is gone, its context held


def test_host_overflow_goes_to_disk_and_the_insert_after_a_match_brings_it_back(tmp_path):
    files = _files(tmp_path)
    tree = KVTree(_bytes(6), host_bytes=_bytes(6), files=files, disk_bytes=_bytes(100))
    keys = [TreeKey.of(f"k{i}") for i in range(3)]
    for i, key in enumerate(keys):
        tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4, fill=100 * i))
    files.flush()
    tiers = {k: tree._roots[k].children[1].tier for k in keys}
    assert tiers == {keys[0]: TreeTier.DISK, keys[1]: TreeTier.HOST, keys[2]: TreeTier.DEVICE}
    (spilled_file,) = (tmp_path / "tree" / "model-a").glob("*.kv")
    tokens, spilled, k = _read(tree, keys[0], [1, 2, 3, 4, 0])
    assert (tokens, spilled) == (4, 4) and torch.equal(k, _cache(4).k[:, :, :4])
    tree.insert(keys[0], [], CTX, [1, 2, 3, 4, 5], _cache(5))  # the next call's insert: back on the device
    assert tree._roots[keys[0]].children[1].tier is TreeTier.DEVICE
    files.flush()
    assert not spilled_file.exists()  # its file went with it (k1 went down to disk to make room)
    assert tree._roots[keys[1]].children[1].tier is TreeTier.DISK


def test_a_restarted_tree_finds_its_conversations_on_disk(tmp_path):
    tree = KVTree(_bytes(100), host_bytes=_bytes(100), files=_files(tmp_path), disk_bytes=_bytes(100))
    key, other = TreeKey.of("conv", tenant="alice"), TreeKey.of("conv", tenant="bob")
    tree.insert(key, [7, 8], CTX, [1, 2, 3, 4], _cache(6, fill=1))
    tree.insert(key, [7, 8], CTX, [1, 2, 5, 6, 7], _cache(7, fill=2))  # a second branch: splits [1, 2]
    assert tree.persist() == 4  # root, the shared [1, 2], and the two branches

    again = KVTree(_bytes(100), files=_files(tmp_path), disk_bytes=_bytes(100))
    assert again.stats().restored == 4 and again.stats().disk_bytes == tree.stats().disk_bytes
    tokens, spilled, k = _read(again, key, [1, 2, 5, 6, 7, 0])
    want = torch.cat([_cache(4, fill=1).k[:, :, :4], _cache(7, fill=2).k[:, :, 4:7]], dim=2)  # shared, then its own
    assert (tokens, spilled) == (7, 7) and torch.equal(k, want)
    tokens, _, k = _read(again, key, [1, 2, 3, 4, 0])
    assert tokens == 6 and torch.equal(k[:, :, 4:], _cache(6, fill=1).k[:, :, 4:6])
    lease = again.match(key, [1, 2, 3])
    assert lease.context == CTX and lease.context_ids == (7, 8)
    lease.release()
    assert again.match(other, [1, 2, 3, 4, 0]) is None  # another tenant's same words find nothing


def test_a_split_inside_a_spilled_node_keeps_both_parts_reading_one_file(tmp_path):
    files = _files(tmp_path)
    tree = KVTree(_bytes(7), files=files, disk_bytes=_bytes(100))
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [], CTX, [1, 2, 3, 4, 5, 6], _cache(6, fill=1))
    tree.insert(b, [], CTX, [9, 9, 9], _cache(3))  # a goes to disk, whole
    assert tree._roots[a].children[1].tier is TreeTier.DISK
    tree.insert(a, [], CTX, [1, 2, 3, 8], _cache(4, fill=1))  # parts inside a's spilled edge
    tokens, _, k = _read(tree, a, [1, 2, 3, 4, 5, 6, 0])
    assert tokens == 6 and torch.equal(k, _cache(6, fill=1).k[:, :, :6])
    top = tree._roots[a].children[1]
    lower = top.children[4]
    assert top.ids == (1, 2, 3) and (lower.tier, lower.offset, lower.ids) == (TreeTier.DISK, 3, (4, 5, 6))
    files.flush()
    assert (tmp_path / "tree" / "model-a" / f"{lower.file}.kv").exists()


def test_a_damaged_file_is_a_miss_for_its_node_and_never_an_error(tmp_path):
    files = _files(tmp_path)
    tree = KVTree(_bytes(100), files=files, disk_bytes=_bytes(100))
    key = TreeKey.of("conv")
    tree.insert(key, [7], CTX, [1, 2, 3, 4], _cache(5))
    tree.persist()
    for path in (tmp_path / "tree" / "model-a").glob("*.kv"):
        data = bytearray(path.read_bytes())
        if b"tree_context" not in data:  # the edge below the context: flip a byte of its KV
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
    again = KVTree(_bytes(100), files=_files(tmp_path), disk_bytes=_bytes(100))
    tokens, _, k = _read(again, key, [1, 2, 3, 4, 0])
    assert tokens == 1 and torch.equal(k, _cache(5).k[:, :, :1])  # the context alone
    assert again.stats().read_errors == 1 and again.stats().nodes == 1


def test_the_disk_budget_drops_the_least_recently_used_and_deletes_their_files(tmp_path):
    files = _files(tmp_path)
    tree = KVTree(_bytes(5), files=files, disk_bytes=_bytes(10))
    keys = [TreeKey.of(f"k{i}") for i in range(4)]
    for i, key in enumerate(keys):
        tree.insert(key, [], CTX, [1, 2, 3, 4, 5], _cache(5, fill=i))
    files.flush()
    stats = tree.stats()
    assert stats.disk_bytes <= _bytes(10) and stats.evictions == 1
    assert len(list((tmp_path / "tree" / "model-a").glob("*.kv"))) == 2
    assert tree.match(keys[0], [1, 2, 3, 4, 5, 0]) is None


def test_files_of_another_model_are_not_read(tmp_path):
    tree = KVTree(_bytes(100), files=_files(tmp_path), disk_bytes=_bytes(100))
    tree.insert(TreeKey.of("conv"), [7], CTX, [1, 2, 3], _cache(4))
    tree.persist()
    other = KVTree(_bytes(100), files=TreeFiles(tmp_path / "tree", "model-b", "tok-a"), disk_bytes=_bytes(100))
    assert other.stats().restored == 0


def test_a_restarted_engine_answers_a_conversation_from_disk_as_computing_it(tmp_path):
    """A conversation answered, the tree persisted, a fresh tree over the same folder: the next
    call reads its KV from disk (layer by layer) and equals the call computed whole."""
    eng, _, (mode, opts, prefix_ids, chunk_ids, _, second_q), spot, alone = restarted_conversation(tmp_path, gated=False)
    reused = eng.run(Prompt(second_q, prefix_ids, chunk_ids, None), mode, opts, reserve_tokens=16, resume=spot)
    assert torch.equal(reused.token_ids, alone.token_ids)
    assert (reused.logits - alone.logits).abs().max().item() <= 1e-4
    a, b = eng.decode(reused, SamplingParams(max_new_tokens=6)), eng.decode(alone, SamplingParams(max_new_tokens=6))
    assert "".join(a) == "".join(b)


def test_pinned_paths_move_to_host_to_make_room_and_never_leave_while_pinned():
    """Agents waiting on tools pin their paths. When pins fill the device, a new conversation's
    insert moves the soonest-expiring pin down to the host tier (still served from there), not
    out of the tree; without a lower tier the pins hold the device and the insert stores nothing."""
    now = [0.0]

    def insert_three(tree: KVTree) -> list[int]:
        added = []
        for i, (key, end) in enumerate(((TreeKey.of("a"), 30.0), (TreeKey.of("b"), 20.0), (TreeKey.of("c"), 0.0))):
            added.append(tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4, fill=10 * i), pin_s=end))
        return added

    spill = KVTree(_bytes(8), clock=lambda: now[0], host_bytes=_bytes(100))
    assert insert_three(spill) == [4, 4, 4]
    tiers = {k: spill._roots[TreeKey.of(k)].children[1].tier for k in "abc"}
    assert tiers == {"a": TreeTier.DEVICE, "b": TreeTier.HOST, "c": TreeTier.DEVICE}  # b's pin ends first
    assert spill.stats().evictions == 0
    tokens, spilled, k = _read(spill, TreeKey.of("b"), [1, 2, 3, 4, 0])
    assert (tokens, spilled) == (4, 4) and torch.equal(k, _cache(4, fill=10).k[:, :, :4])

    alone = KVTree(_bytes(8), clock=lambda: now[0])
    assert insert_three(alone) == [4, 4, 0]  # the pins hold; the unpinned newcomer is not stored
    assert alone.stats().evictions == 0


def test_warm_brings_a_conversations_disk_path_to_host_before_its_match(tmp_path):
    """What a conversation left on disk is read into CPU memory while its next call retrieves:
    the match then reads no file, and supplies the same KV."""
    files = _files(tmp_path)
    tree = KVTree(_bytes(6), host_bytes=_bytes(6), files=files, disk_bytes=_bytes(100))
    keys = [TreeKey.of(f"k{i}") for i in range(3)]
    for i, key in enumerate(keys):
        tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4, fill=100 * i))
    files.flush()
    node = tree._roots[keys[0]].children[1]
    assert node.tier is TreeTier.DISK
    assert tree.warm(keys[0], [1, 2, 3, 4, 9]) == 4
    assert node.tier is TreeTier.HOST and node.file is None and tree.stats().warmed_tokens == 4
    files.flush()
    reads = []
    real = files.read
    files.read = lambda name: reads.append(name) or real(name)  # type: ignore[method-assign]
    tokens, spilled, k = _read(tree, keys[0], [1, 2, 3, 4, 0])
    assert (tokens, spilled, reads) == (4, 4, []) and torch.equal(k, _cache(4).k[:, :, :4])
    assert tree.warm(TreeKey.of("none"), [1, 2]) == 0 and tree.warm(keys[0], [1, 2, 3, 4]) == 0  # nothing on disk


def test_warm_of_a_damaged_file_brings_nothing_and_raises_nothing(tmp_path):
    files = _files(tmp_path)
    tree = KVTree(_bytes(4), files=files, disk_bytes=_bytes(100), host_bytes=_bytes(100))
    key = TreeKey.of("conv")
    tree.insert(key, [], CTX, [1, 2, 3, 4], _cache(4))
    tree.insert(TreeKey.of("other"), [], CTX, [5, 6, 7, 8], _cache(4))  # conv to host
    tree.insert(TreeKey.of("third"), [], CTX, [5, 6, 7, 8], _cache(4))
    tree._host_room(_bytes(100))  # everything on the host goes to disk
    files.flush()
    node = tree._roots[key].children[1]
    assert node.tier is TreeTier.DISK
    path = tmp_path / "tree" / "model-a" / f"{node.file}.kv"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tree.warm(key, [1, 2, 3, 4]) == 0 and node.tier is TreeTier.DISK and node.refs == 0


def test_a_conversations_prefetch_warms_the_path_its_last_call_left(tmp_path):
    """`Conversations.prefetch` (the pipeline calls it as a call's retrieval starts) brings what
    the conversation's last call left, prompt and answer, from disk to CPU memory."""
    d = tiny_model_dir(tmp_path / "model", "llama", seed=11)
    lm = load_model(str(d), device="cpu", dtype="float32")
    eng = Engine(lm, tree=TreeConfig(64 << 20, host_bytes=64 << 20, disk_bytes=64 << 20,
                                     files=TreeFiles(tmp_path / "tree", lm.fingerprint, lm.tokenizer_fingerprint)))
    fmt = eng.prompt
    trees = eng.conversations
    prefix_ids, chunk_ids = fmt.prefix_ids(), [fmt.chunk_ids("The secret number is 4721.")]
    kvs = [eng.prefill(prefix_ids, ids) for ids in chunk_ids]
    opts, mode, q = BlendOptions(recompute_ratio=0.2), Mode.BLEND, fmt.question_ids("What is the secret number?")
    spot = trees.lease(mode, prefix_ids, chunk_ids, ["c0"], q, options=opts, conversation="agent-1")
    res = eng.run(Prompt(q, prefix_ids, chunk_ids, kvs), mode, opts, reserve_tokens=8)
    stream = eng.decode(res, SamplingParams(max_new_tokens=4))
    list(stream)
    trees.remember(spot, mode, res, len(q), len(prefix_ids), stream.token_ids)
    assert trees.prefetch("agent-1") == 0  # all on the device: nothing to bring up
    trees.tree.shrink(0)  # memory pressure: the device's nodes go to the host ...
    with trees.tree._lock:
        trees.tree._host_room(trees.tree.host_budget)  # ... and the host's to disk
    on_disk = [n for n in trees.tree._all() if n.tier is TreeTier.DISK and n.ids]
    assert on_disk
    assert trees.prefetch("agent-1") == sum(len(n.ids) for n in on_disk) > len(q)  # the question and the answer
    assert trees.prefetch("agent-2") == 0  # a conversation never seen


def test_a_disk_node_is_read_only_when_that_is_sooner_than_computing_it(tmp_path):
    """The disk's bytes per second, measured on the tree's own reads, against the engine's
    prompt tokens per second: a node slower to read than to compute is left for the pass to
    compute (the match stops before it); unmeasured rates read."""
    rate: list[float | None] = [None]
    files = _files(tmp_path)
    tree = KVTree(_bytes(5), files=files, disk_bytes=_bytes(100), compute_rate=lambda: rate[0])
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4, fill=1))
    tree.insert(b, [], CTX, [5, 6, 7, 8], _cache(4))  # a's path goes to disk
    files.flush()
    assert _read(tree, a, [1, 2, 3, 4, 0])[:2] == (4, 4)  # the engine's rate unmeasured: read (and timed)
    rate[0] = 1e15  # an engine that computes any node before its file is read
    assert _read(tree, a, [1, 2, 3, 4, 0])[:2] == (0, 0) and tree.stats().reads_skipped == 1
    rate[0] = 1e-3  # an engine slower than the disk
    assert _read(tree, a, [1, 2, 3, 4, 0])[:2] == (4, 4) and tree.stats().reads_skipped == 1


def test_a_new_path_goes_to_host_when_leases_fill_the_device():
    """Calls in flight lease their paths, which cannot move: a new path that finds the device
    full of them is kept in CPU memory (served from there), not dropped."""
    tree = KVTree(_bytes(4), host_bytes=_bytes(100))
    a, b = TreeKey.of("a"), TreeKey.of("b")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4))
    lease = tree.match(a, [1, 2, 3, 4, 0])  # a's next call is in flight
    assert lease is not None
    assert tree.insert(b, [], CTX, [5, 6, 7, 8], _cache(4, fill=7)) == 4
    assert tree._roots[b].children[5].tier is TreeTier.HOST and tree._roots[a].children[1].tier is TreeTier.DEVICE
    lease.release()
    tokens, spilled, k = _read(tree, b, [5, 6, 7, 8, 0])
    assert (tokens, spilled) == (4, 4) and torch.equal(k, _cache(4, fill=7).k[:, :, :4])
    assert KVTree(_bytes(4)).insert(b, [], CTX, [5, 6, 7, 8], _cache(4)) == 4  # (room: stored on the device)


def test_a_node_warmed_between_a_match_and_its_read_is_read_from_memory(tmp_path):
    """The prefetch thread may bring a disk node up to CPU memory after a match found it on
    disk and before the match reads it: the read takes the memory copy, never a miss."""
    files = _files(tmp_path)
    tree = KVTree(_bytes(100), host_bytes=_bytes(100), files=files, disk_bytes=_bytes(100))
    key = TreeKey.of("conv")
    tree.insert(key, [7], CTX, [1, 2, 3, 4], _cache(5, fill=3))
    tree.persist()
    again = KVTree(_bytes(100), host_bytes=_bytes(100), files=_files(tmp_path), disk_bytes=_bytes(100))
    with again._lock:
        _, parts = again._find(key, (1, 2, 3, 4, 0))
        for part in parts:
            part.node.refs += 1
    assert all(p.k is None for p in parts)  # the match saw the path on disk
    assert again.warm(key, [1, 2, 3, 4]) == 5  # then the prefetch brought it up
    read = again.disk.read(parts)
    assert len(read) == 2 and again.stats().read_errors == 0
    assert all(p.k is None and p.node.tier is TreeTier.HOST for p in read)  # copied from the host pool, not read
    out = KVCache(2, 1, 3, 16, torch.float32, torch.device("cpu"))
    for p in read:
        out.k[:, :, p.node.start:p.node.start + p.n] = again._gather(p.node, p.n)[0]
    assert torch.equal(out.k[:, :, :5], _cache(5, fill=3).k[:, :, :5])


def test_spilled_nodes_are_readable_by_the_servers_user_only(tmp_path):
    """A node's file holds its tenant and the conversation's token ids: 0600 files in 0700
    folders; a folder made before with wider modes is tightened."""
    import stat

    (tmp_path / "tree").mkdir(mode=0o755)
    (tmp_path / "tree").chmod(0o755)
    files = _files(tmp_path)
    tree = KVTree(_bytes(6), host_bytes=_bytes(6), files=files, disk_bytes=_bytes(100))
    for i in range(3):
        tree.insert(TreeKey.of(f"k{i}", tenant="alice"), [], CTX, [1, 2, 3, 4], _cache(4, fill=100 * i))
    files.flush()
    spilled = list((tmp_path / "tree" / "model-a").glob("*.kv"))
    assert spilled
    assert {stat.S_IMODE(p.stat().st_mode) for p in spilled} == {0o600}
    for folder in (tmp_path / "tree", tmp_path / "tree" / "model-a"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_room_on_the_host_is_never_made_from_the_node_an_insert_brings_back():
    """A conversation's node is on the host (full); its next call's insert brings it back to the
    device, and the device room for it spills another node, for which the host makes room. That
    room must not come from the node being brought back: dropped from the tree there (before),
    it took the insert's new turn with it, and the tree went on counting its device bytes."""
    tree = KVTree(_bytes(8), host_bytes=_bytes(4))
    a, b, c = TreeKey.of("a"), TreeKey.of("b"), TreeKey.of("c")
    tree.insert(a, [], CTX, [1, 2, 3, 4], _cache(4, fill=10))
    tree.insert(b, [], CTX, [5, 6, 7, 8], _cache(4, fill=20))
    tree.insert(c, [], CTX, [9, 10, 11, 12], _cache(4, fill=30))  # the device full: a's turn spills to the host
    assert tree._roots[a].children[1].tier is TreeTier.HOST and tree.stats().host_bytes == _bytes(4)
    call = _cache(6, fill=10)  # a's next call: its path as kept, then two new tokens
    lease = tree.match(a, [1, 2, 3, 4, 13, 14])
    assert lease is not None and lease.tokens == 4
    lease.write_into(call)
    lease.release()
    tree.insert(a, [], CTX, [1, 2, 3, 4, 13, 14], call)
    tokens, _, k = _read(tree, a, [1, 2, 3, 4, 13, 14, 0])
    assert tokens == 6 and torch.equal(k, _cache(6, fill=10).k[:, :, :6])  # the path and its new turn, kept
    on_device = sum(n.nbytes for n in tree._all() if n.tier is TreeTier.DEVICE)
    assert tree.stats().nbytes == on_device <= _bytes(8)  # the tree counts what it holds, no more
