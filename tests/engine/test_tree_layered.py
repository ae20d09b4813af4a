"""A KV tree path on disk is read layer by layer, as chunk KV is: the prompt pass takes each
layer as it arrives (parked on the read, never blocking the scheduler), and damage found
after the match costs the request its tree hit, never its answer."""

from __future__ import annotations

import threading

import torch

from ragkv.engine import BlendOptions, Engine, Prompt, SamplingParams, TreeConfig, load_model
from ragkv.engine.forward import LayerWork
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.tree import KVTree, TreeContext, TreeKey
from ragkv.engine.request import Finished, PromptChunk, Request, TokenOut
from ragkv.engine.scheduler import Scheduler
from ragkv.engine.work import WaitFor
from ragkv.errors import KVFormatError
from ragkv.evals.testing import tiny_model_dir
from ragkv.kvstore.layered import LayerGate
from ragkv.kvstore.tree_files import TreeFiles
from ragkv.types import KVSource, Mode

CTX = TreeContext(prefix_tokens=1, chunk_end=2, chunk_tokens=1, used_chunks=(0,), chunk_scores=(0.5,))


class _Gate(LayerGate):
    """A gate whose waits give up after 30 s: a pass that blocks on it (a regression) fails, never hangs."""

    def wait(self, layer: int, timeout: float | None = 30.0) -> None:
        super().wait(layer, timeout)


class _GatedFiles:
    """TreeFiles whose layered reads publish a layer only when the test says (`gates`)."""

    def __init__(self, inner: TreeFiles) -> None:
        self.inner = inner
        self.gates: list[LayerGate] = []

    def open(self, name: str):
        k, v = self.inner.read(name)
        gate = _Gate(k.shape[0])
        self.gates.append(gate)
        return k, v, gate

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def restarted_conversation(tmp_path, gated: bool = True):
    """A tiny model's engine whose tree holds one answered call on disk, restarted over the
    same files (`gated`: whose reads the test gates); the second call's prompt, its spot and
    its answer computed alone."""
    d = tiny_model_dir(tmp_path / "model", "llama", seed=11)
    lm = load_model(str(d), device="cpu", dtype="float32")
    make = lambda: TreeFiles(tmp_path / "tree", lm.fingerprint, lm.tokenizer_fingerprint)  # noqa: E731 - two trees, one folder
    eng = Engine(lm, tree=TreeConfig(64 << 20, files=make(), disk_bytes=64 << 20))
    fmt = eng.prompt
    prefix_ids, chunks = fmt.prefix_ids(), ["Paris is the capital of France.", "The secret number is 4721."]
    chunk_ids = [fmt.chunk_ids(c) for c in chunks]
    kvs = [eng.prefill(prefix_ids, ids) for ids in chunk_ids]
    opts, mode = BlendOptions(recompute_ratio=0.2), Mode.BLEND
    first_q = fmt.question_ids("What is the secret number?")
    spot = eng.conversations.lease(mode, prefix_ids, chunk_ids, chunks, first_q, options=opts)
    res = eng.run(Prompt(first_q, prefix_ids, chunk_ids, kvs), mode, opts, reserve_tokens=16)
    stream = eng.decode(res, SamplingParams(max_new_tokens=5))
    list(stream)
    eng.conversations.remember(spot, mode, res, len(first_q), len(prefix_ids), stream.token_ids)
    assert eng.conversations.persist() >= 2
    files = _GatedFiles(make()) if gated else make()
    eng = Engine(lm, tree=TreeConfig(64 << 20, files=files, disk_bytes=64 << 20))  # the restart: the same model
    second_q = [*first_q, *stream.token_ids[:4], *fmt.chunk_ids("\nTool: done.\n")]
    alone = eng.run(Prompt(second_q, prefix_ids, chunk_ids, kvs, first_q), mode, opts, reserve_tokens=16)
    spot = eng.conversations.lease(mode, prefix_ids, chunk_ids, chunks, second_q, options=opts, select_ids=first_q)
    assert spot is not None and spot.lease is not None and spot.lease.spilled == spot.lease.tokens > 0
    return eng, files, (mode, opts, prefix_ids, chunk_ids, first_q, second_q), spot, alone


def test_a_disk_path_is_read_layer_by_layer_as_the_pass_reaches_each(tmp_path):
    eng, files, (mode, opts, prefix_ids, chunk_ids, _, second_q), spot, alone = restarted_conversation(tmp_path)
    assert files.gates and all(g.ready == 0 for g in files.gates)  # the match started the reads, nothing is in
    steps = eng.run_steps(Prompt(second_q, prefix_ids, chunk_ids, None), mode, opts, 16, spot)
    assert isinstance(next(steps), WaitFor)  # layer 0 not read yet: the pass parks on it
    for g in files.gates:
        g.publish(1)
    assert isinstance(next(steps), LayerWork)  # layer 0 runs while layer 1 is still being read
    assert isinstance(next(steps), WaitFor)  # and the pass parks again on layer 1
    for g in files.gates:
        g.publish(g.num_layers)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        reused = done.value
    assert torch.equal(reused.token_ids, alone.token_ids)
    assert (reused.logits - alone.logits).abs().max().item() <= 1e-4


def test_damage_found_mid_pass_costs_the_tree_hit_not_the_answer(tmp_path):
    eng, files, (mode, opts, prefix_ids, chunk_ids, first_q, second_q), spot, _ = restarted_conversation(tmp_path)

    def request(tree):
        return Request(mode=mode, prefix_ids=tuple(prefix_ids), question_ids=tuple(second_q), select_ids=tuple(first_q),
                       chunks=tuple(PromptChunk(tuple(ids), source=KVSource.COMPUTED_MISSING) for ids in chunk_ids),
                       options=opts, sampling=SamplingParams(max_new_tokens=6), tree=tree)

    def serve(req: Request, during=None) -> list[int]:
        sched, events, ended = Scheduler(), [], threading.Event()

        def sink(out: object) -> None:
            events.append(out)
            ended.set() if isinstance(out, Finished) else None

        sched.submit(req, eng.work(req), sink)
        if during is not None:
            during()
        assert ended.wait(120)
        sched.close()
        assert isinstance(events[-1], Finished) and events[-1].error is None, events[-1]
        return [e.token_id for e in events if isinstance(e, TokenOut)]

    without = serve(request(None))

    def damage() -> None:  # layer 0 passes its checksums, layer 1 does not
        for g in files.gates:
            g.publish(1)
            g.fail(KVFormatError("checksum mismatch in block 1 (the test's)"))

    req = request(spot)
    assert serve(req, damage) == without
    assert req.tree is not None and req.tree.lease is None  # served as if the tree had held nothing
    assert eng.conversations.stats().read_errors >= 1


def test_a_disk_path_whose_read_stalls_mid_pass_is_computed_after_the_kv_wait(tmp_path):
    """The tree's layered disk read delivers its first layer and then hangs: the pass's wait on
    the next runs out after the request's `kv_wait_s`, and the prompt is computed without the
    tree, answering as it would have alone."""
    eng, files, (mode, opts, prefix_ids, chunk_ids, first_q, second_q), spot, _ = restarted_conversation(tmp_path)

    def serve(tree) -> tuple[Request, list[int]]:
        req = Request(mode=mode, prefix_ids=tuple(prefix_ids), question_ids=tuple(second_q), select_ids=tuple(first_q),
                      chunks=tuple(PromptChunk(tuple(ids), source=KVSource.COMPUTED_MISSING) for ids in chunk_ids),
                      options=opts, sampling=SamplingParams(max_new_tokens=6), tree=tree, kv_wait_s=0.3)
        sched, events, ended = Scheduler(), [], threading.Event()
        sched.submit(req, eng.work(req), lambda out: (events.append(out), isinstance(out, Finished) and ended.set()))
        assert ended.wait(60), "the request waited on the stalled read"
        sched.close()
        assert isinstance(events[-1], Finished) and events[-1].error is None, events[-1]
        return req, [e.token_id for e in events if isinstance(e, TokenOut)]

    _, without = serve(None)
    for g in files.gates:
        g.publish(1)  # one layer, then nothing
    req, tokens = serve(spot)
    assert tokens == without
    assert req.tree is not None and req.tree.lease is None  # the tree's hit given up, not the answer


def test_a_late_damaged_block_fails_the_read_after_the_match_and_the_file_goes(tmp_path):
    """Real files of several checksum blocks: the header and first blocks pass, so the match
    leases the path; its read fails at the damaged block, and the next match is a miss."""
    files = TreeFiles(tmp_path / "tree", "model-a", "tok-a")
    tree = KVTree(1 << 30, files=files, disk_bytes=1 << 30)
    n = 4096
    cache = KVCache(2, 4, 64, n + 4, torch.float32, torch.device("cpu"))  # K and V 8 MiB each: 16 blocks
    cache.k[:, :, :n] = torch.randn(2, 4, n, 64)
    cache.v[:, :, :n] = torch.randn(2, 4, n, 64)
    cache.length = n
    key = TreeKey.of("conv")
    ids = list(range(1, n))
    tree.insert(key, [7], CTX, ids, cache)
    tree.persist()
    (path,) = [p for p in (tmp_path / "tree" / "model-a").glob("*.kv") if p.stat().st_size > 1 << 20]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # in V's last layer
    path.write_bytes(bytes(data))

    again = KVTree(1 << 30, files=TreeFiles(tmp_path / "tree", "model-a", "tok-a"), disk_bytes=1 << 30)
    lease = again.match(key, [*ids, 0])
    assert lease is not None and lease.tokens == n  # the header and the first blocks passed
    out = KVCache(2, 4, 64, n + 8, torch.float32, torch.device("cpu"))
    try:
        lease.write_into(out)
        raise AssertionError("the damaged block was not found")
    except KVFormatError:
        pass
    assert lease.failed
    lease.release()
    again.files.flush()
    assert not path.exists()  # the damaged file is not read again
    assert again.stats().read_errors >= 1
    later = again.match(key, [*ids, 0])
    assert later is not None and later.tokens == 1  # the context alone: the damaged node is gone
    later.release()
