"""Decode over the decode pool (engine/decode_graphs.py): the same tokens as ragged decode, shapes
that stay still within a bucket, a pool that holds many requests in place, and (on CUDA) graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ragkv.engine import Engine, Prompt
from ragkv.engine.decode import decode_batch, pick_greedy
from ragkv.engine.decode_graphs import PooledDecoder, _Inputs, bucket, key_bucket, unsupported_reason
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.decode_pool import DecodePool, DecodePoolFullError
from ragkv.types import Mode


def _prompts(engine: Engine, lengths: list[int], seed: int = 0, reserve: int = 4):
    g = torch.Generator().manual_seed(seed)
    vocab = engine.lm.tokenizer.vocab_size
    return [engine.run(Prompt(torch.randint(5, vocab, (n,), generator=g).tolist()), Mode.FULL,
                       reserve_tokens=reserve) for n in lengths]


def _greedy_run(step, caches: list[KVCache], first: list[int], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens, out, logits_seen = list(first), [[] for _ in caches], []
    for _ in range(steps):
        logits = step(caches, tokens)  # [B, V]
        logits_seen.append(logits.clone())
        tokens = pick_greedy(logits)
        for row, t in zip(out, tokens):
            row.append(t)
    return out, logits_seen


def test_pooled_decode_gives_ragged_decodes_tokens_for_requests_of_different_lengths(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [7, 40, 19], reserve=2)  # room for 2 tokens: every cache must grow
    first = [int(p.logits.argmax()) for p in prompts]
    ragged = [copy.deepcopy(p.cache) for p in prompts]
    pooled = [copy.deepcopy(p.cache) for p in prompts]
    want, want_logits = _greedy_run(lambda c, t: decode_batch(tiny_lm, c, t), ragged, first, 24)
    dec = PooledDecoder(tiny_lm, pool_tokens=1024, graphs=False)
    got, got_logits = _greedy_run(dec.step, pooled, first, 24)
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(got_logits, want_logits)) < 1e-4
    assert dec.stats.eager_steps == 24 and dec.stats.ragged_steps == 0
    assert all(c.pool is dec.pool for c in pooled)
    for c, r in zip(pooled, ragged):  # the caches' KV is the ragged path's, now in the pool
        assert c.length == r.length
        # float32 noise of batched against one-at-a-time matmuls: up to 1.4e-5 on |K| ~6 (host-dependent)
        assert torch.allclose(c.k[:, :, :c.length], r.k[:, :, :r.length], atol=1e-4)


def test_a_batch_that_changes_size_mid_run_keeps_each_requests_tokens(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [12, 30, 5, 21], seed=1)
    first = [int(p.logits.argmax()) for p in prompts]
    dec = PooledDecoder(tiny_lm, pool_tokens=1024, graphs=False)
    alone = []
    for p, t in zip(prompts, first):  # each request by itself, ragged
        toks, _ = _greedy_run(lambda c, x: decode_batch(tiny_lm, c, x), [copy.deepcopy(p.cache)], [t], 10)
        alone.append(toks[0])
    caches = [copy.deepcopy(p.cache) for p in prompts]
    got: list[list[int]] = [[] for _ in caches]
    tokens = list(first)
    live = [0, 1, 2, 3]
    for step in range(10):
        if step == 4:  # request 2 ends: its run goes back, the batch shrinks from 4 rows to 3 (bucket 4)
            dec.release(caches[2])
            live.remove(2)
        picks = pick_greedy(dec.step([caches[j] for j in live], [tokens[j] for j in live]))
        for j, t in zip(live, picks):
            got[j].append(t)
            tokens[j] = t
    for j in (0, 1, 3):
        assert got[j] == alone[j], f"request {j}"
    assert got[2] == alone[2][:4]
    # its run went back with its KV (an ended request's KV is not copied out): the cache is empty
    assert caches[2].pool is None and caches[2].length == 0 == caches[2].k.shape[2]


class _Shapes(TorchDispatchMode):
    """Every op's name and output shapes, in order: a step's whole shape signature."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.seen.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


def test_the_pooled_step_is_shape_static_within_a_bucket(tiny_lm) -> None:
    """What a captured graph needs: step after step of one bucket runs the same ops on the same
    shapes (positions, lengths and runs are values in buffers, never shapes)."""
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [9, 33, 20], seed=2, reserve=64)
    dec = PooledDecoder(tiny_lm, pool_tokens=1024, graphs=False)
    caches = [p.cache for p in prompts]
    tokens = [int(p.logits.argmax()) for p in prompts]
    dec.step(caches, tokens)  # the first step admits the caches (copies): not a steady step
    signatures = []
    for _ in range(20):
        x = dec._buckets[(bucket(3), key_bucket(max(c.length for c in caches) + 1))].inputs
        with _Shapes() as rec:
            dec._forward(x)
        signatures.append(rec.seen)
        tokens = pick_greedy(dec.step(caches, tokens))
    assert len(signatures[0]) > 50
    assert all(s == signatures[0] for s in signatures), "a step's shapes changed within one bucket"
    # and the check can fail: another bucket (4 rows) records another signature
    with _Shapes() as rec:
        dec._forward(_Inputs.empty(4, 256, torch.device("cpu")))
    assert rec.seen != signatures[0]


def test_padded_rows_touch_only_the_scratch_page(tiny_lm) -> None:
    """A bucket's padding (and the start-up capture, every row padding) writes and reads the
    scratch page alone: the requests' runs keep their KV."""
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [10, 20], seed=5, reserve=8)
    dec = PooledDecoder(tiny_lm, pool_tokens=512, graphs=False)
    assert dec.warm() == 0  # no CUDA: nothing to capture
    caches = [p.cache for p in prompts]
    dec.step(caches, [3, 4])  # 2 rows, no padding: admitted
    k_before, v_before = dec.pool.k[:, :, :dec.pool.scratch].clone(), dec.pool.v[:, :, :dec.pool.scratch].clone()
    x = _Inputs.empty(8, 256, torch.device("cpu"))
    dec._fill(x, [], [], [], 8)  # a bucket of 8 padded rows
    assert set(x.slots.tolist()) == set(x.starts.tolist()) == {dec.pool.scratch} and set(x.lens.tolist()) == {1}
    logits = dec._forward(x)
    assert logits.shape[0] == 8 and torch.isfinite(logits).all()
    assert torch.equal(dec.pool.k[:, :, :dec.pool.scratch], k_before)
    assert torch.equal(dec.pool.v[:, :, :dec.pool.scratch], v_before)


@pytest.mark.parametrize("arch", ["llama", "gemma", "olmo2", "granite", "cohere", "seed_oss", "apertus"])
def test_the_pooled_step_reads_no_value_on_the_host(arch: str, tmp_path) -> None:
    """What a CUDA graph needs besides still shapes, checked on the CPU for dense families that
    decode over the pool: run on fake tensors (values unknown), the step never needs a tensor's
    value on the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`) nor makes an output whose shape
    depends on values (`nonzero`): either would raise. (A planted `int(t)` does.)"""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from ragkv.engine import load_model
    from ragkv.evals.testing import tiny_model_dir

    lm = load_model(str(tiny_model_dir(tmp_path / arch, arch, family=arch != "llama")), device="cpu",
                    dtype="float32")
    assert unsupported_reason(lm.adapter) is None, arch
    prompts = _prompts(Engine(lm), [9, 21], seed=7, reserve=8)
    dec = PooledDecoder(lm, pool_tokens=512, graphs=False)
    dec.step([p.cache for p in prompts], [3, 4])
    x = dec._buckets[(2, 256)].inputs
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the weights are constants; inputs and pool unknown
    with torch.inference_mode(), fake:
        fx = _Inputs(*(fake.from_tensor(t) for t in (x.tokens, x.pos, x.slots, x.starts, x.lens, x.keys)))
        dec.pool.k, dec.pool.v = fake.from_tensor(dec.pool.k), fake.from_tensor(dec.pool.v)
        logits = dec._forward(fx)  # raises on a host read or a value-dependent shape
        assert tuple(logits.shape) == (2, lm.model.get_output_embeddings().weight.shape[0])
        with pytest.raises(DataDependentOutputException):
            int(fx.lens[0])


def test_the_pool_grows_runs_in_place_moves_them_when_it_must_and_reuses_what_is_released() -> None:
    pool = DecodePool(2, 1, 4, capacity_tokens=320, dtype=torch.float32, device="cpu", page_tokens=16)
    assert pool.capacity == 304  # 20 pages, the last one scratch
    a, b = (KVCache(2, 1, 4, 8, torch.float32, torch.device("cpu")) for _ in range(2))
    for c, fill in ((a, 1.0), (b, 2.0)):
        c.k[:, :, :5], c.v[:, :, :5], c.length = fill, -fill, 5
    pool.admit(a, 16)  # the first run starts the pool
    pool.admit(b, 16)  # the next keeps half the slack after a before it: room for a to grow
    assert pool.run_of(a).start == 0 and pool.run_of(b).start == 144 and pool.copied_tokens == 10
    b.ensure(30)  # the pages after b are free: it grows in place, no copy
    assert pool.run_of(b).start == 144 and pool.run_of(b).size == 32 and pool.moves == 0
    assert float(b.v[1, 0, 0, 0]) == -2.0 and b.k.data_ptr() == pool.k[:, :, 144:].data_ptr()
    c = KVCache(2, 1, 4, 8, torch.float32, torch.device("cpu"))
    pool.admit(c, 96)  # no range has 96 of slack to halve: c starts the largest, right after a
    assert pool.run_of(c).start == 16
    a.ensure(40)  # c sits right after a: a moves (and doubles), its KV with it
    assert pool.moves == 1 and pool.run_of(a).start == 208 and pool.run_of(a).size == 48
    assert float(a.k[0, 0, 4, 0]) == 1.0 and pool.copied_tokens == 15
    d = KVCache(2, 1, 4, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(DecodePoolFullError, match="no run of 96 free tokens"):
        pool.admit(d, 96)  # 128 slots are free, in four pieces
    pool.release(a)
    assert a.pool is None and float(a.k[0, 0, 4, 0]) == 1.0 and a.k.shape[2] == 5  # its KV copied out
    pool.admit(d, 64)  # a's pages, merged with the free ones beside them, are taken again
    assert pool.run_of(d).start == 208
    with pytest.raises(ValueError, match="cannot enter a decode pool"):
        pool.admit(KVCache(3, 1, 4, 8, torch.float32, torch.device("cpu")), 16)


def test_a_full_pool_falls_back_to_ragged_decode_and_counts_it(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [40, 40], seed=3)
    dec = PooledDecoder(tiny_lm, pool_tokens=64, graphs=False)  # 48 slots for requests: one fits, not two
    want = decode_batch(tiny_lm, [copy.deepcopy(p.cache) for p in prompts], [3, 4])
    got = dec.step([p.cache for p in prompts], [3, 4])
    assert dec.stats.ragged_steps == 1 and torch.allclose(got, want, atol=1e-5)


def test_families_that_need_more_than_sdpa_say_why(tmp_path) -> None:
    from ragkv.engine import load_model
    from ragkv.evals.testing import tiny_model_dir

    gemma2 = load_model(str(tiny_model_dir(tmp_path / "g2", "gemma2", family=True)), device="cpu", dtype="float32")
    reason = unsupported_reason(gemma2.adapter)
    assert reason is not None and ("soft-capped" in reason or "sliding" in reason)
    with pytest.raises(ValueError, match="cannot decode over the pool"):
        PooledDecoder(gemma2, pool_tokens=256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_the_eager_steps_tokens(tiny_llama_dir) -> None:
    from ragkv.engine import load_model

    lm = load_model(str(tiny_llama_dir), device="cuda", dtype="float32")
    engine = Engine(lm)
    prompts = _prompts(engine, [17, 50, 33], seed=4, reserve=40)
    first = [int(p.logits.argmax()) for p in prompts]
    eager = PooledDecoder(lm, pool_tokens=2048, graphs=False)
    want, _ = _greedy_run(eager.step, [copy.deepcopy(p.cache) for p in prompts], first, 16)
    graphs = PooledDecoder(lm, pool_tokens=2048, graphs=True)
    assert graphs.warm((1, 2, 4)) == 3  # start-up: one graph per batch bucket, every row padding
    got, _ = _greedy_run(graphs.step, [copy.deepcopy(p.cache) for p in prompts], first, 16)
    assert got == want
    assert graphs.stats.captures == 3 and graphs.stats.capture_failures == 0  # 3 rows replay bucket 4's graph
    assert graphs.stats.graph_steps == 16


def test_the_scheduler_decodes_over_the_engines_pool_and_gives_every_run_back(tiny_lm) -> None:
    """Requests of every mode through the scheduler, batched over the pool (--decode-pool on): the
    tokens each gets alone with ragged decode; every run goes back when its request ends."""
    from ragkv.engine.decode_graphs import DecodeConfig
    from tests.engine.test_scheduler import _alone, _together

    alone = _alone(Engine(tiny_lm))
    engine = Engine(tiny_lm, decode=DecodeConfig(pool="on", pool_bytes=8 << 20))
    assert engine.decoder is not None and not engine.decoder.graphs  # no CUDA here: eager steps
    together, _, _ = _together(engine, slice_s=1e-4)  # prompts interleave with the pooled decode steps
    assert together == alone
    stats = engine.decoder.stats
    assert stats.eager_steps > 0 and stats.ragged_steps == 0
    assert engine.decoder.pool.used == 0, "a finished request kept its run"


def test_a_pool_too_small_for_everyone_stays_within_itself_and_changes_no_answer(tiny_lm) -> None:
    """The pool under pressure: 12 requests of every mode at once through a pool that holds about
    one of them. A prompt pass that finds no run makes a cache of its own and decodes ragged, the
    others decode over the pool; each request's tokens are the ones it gets alone, the pool never
    holds more than it has, and every run comes back."""
    from ragkv.engine.decode_graphs import DecodeConfig
    from tests.engine.test_scheduler import _alone, _together

    alone = _alone(Engine(tiny_lm))
    per_token = Engine(tiny_lm).kv_bytes_per_token
    engine = Engine(tiny_lm, decode=DecodeConfig(pool="on", pool_bytes=300 * per_token))  # ~1 request's room
    dec = engine.decoder
    assert dec is not None
    held: list[int] = []
    step = dec.step

    def watched(caches, tokens):  # the pool's holding at every step, against its capacity
        held.append(dec.pool.used)
        return step(caches, tokens)

    dec.step = watched  # type: ignore[method-assign]
    together, _, _ = _together(engine, slice_s=1e-4, rounds=3)
    assert together == alone * 3
    assert held and max(held) <= dec.pool.capacity
    assert dec.stats.ragged_steps > 0 and dec.stats.eager_steps > 0, dec.stats  # some ragged, some over the pool
    assert dec.pool.used == 0, "a finished request kept its run"


def test_a_run_that_cannot_grow_leaves_the_pool_with_its_kv_and_decodes_on(tiny_lm) -> None:
    """Two requests fill the pool exactly; when their runs must grow there is no page free: each
    one's KV is copied out of the pool and it decodes ragged from there (before, the step raised
    DecodePoolFullError), with the tokens ragged decode gives, and every page comes back."""
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [30, 30], seed=9, reserve=2)  # caches of 32 tokens: two pages each
    ragged_caches = [copy.deepcopy(p.cache) for p in prompts]
    dec = PooledDecoder(tiny_lm, pool_tokens=4 * 16 + 16, graphs=False)  # four pages and the scratch one
    first = [int(p.logits.argmax()) for p in prompts]
    got, _ = _greedy_run(dec.step, [p.cache for p in prompts], first, 6)
    want, _ = _greedy_run(lambda c, t: decode_batch(tiny_lm, c, t), ragged_caches, first, 6)
    assert got == want
    assert dec.stats.left_pool >= 1 and dec.stats.eager_steps >= 1 and dec.stats.ragged_steps >= 1, dec.stats
    for p in prompts:
        dec.release(p.cache)
    assert dec.pool.used == 0


def test_decode_settings_are_checked_and_auto_is_ragged_off_cuda(tiny_lm) -> None:
    from ragkv.engine.decode_graphs import DecodeConfig

    assert DecodeConfig().decoder(tiny_lm) is None  # auto on a CPU: ragged, the faster path here
    assert DecodeConfig(pool="off").decoder(tiny_lm) is None
    with pytest.raises(ValueError, match="decode pool must be auto, on or off"):
        DecodeConfig(pool="yes")
    with pytest.raises(ValueError, match="cuda graphs must be auto or off"):
        DecodeConfig(cuda_graphs="on")


def test_a_requests_prompt_cache_is_a_run_of_the_pool_so_it_decodes_with_no_copy(tiny_lm) -> None:
    import gc

    from ragkv.engine.decode_graphs import DecodeConfig

    engine = Engine(tiny_lm, decode=DecodeConfig(pool="on", pool_bytes=8 << 20))
    dec = engine.decoder
    want = _prompts(Engine(tiny_lm), [12, 25], seed=6, reserve=8)  # the same prompts, caches of their own
    got = _prompts(engine, [12, 25], seed=6, reserve=8)
    assert all(r.cache.pool is dec.pool for r in got) and dec.pool.used > 0
    first = [int(r.logits.argmax()) for r in got]
    assert first == [int(r.logits.argmax()) for r in want]
    toks, _ = _greedy_run(dec.step, [r.cache for r in got], first, 6)
    ragged, _ = _greedy_run(lambda c, t: decode_batch(tiny_lm, c, t), [r.cache for r in want], first, 6)
    assert toks == ragged
    assert dec.pool.copied_tokens == 0  # the prompt pass wrote where decode reads: nothing moved
    held = dec.pool.used
    del got  # a pass dropped without release (failed, cancelled): its run comes back at the next take
    gc.collect()
    spare = dec.pool.new_cache(16)
    assert spare is not None and dec.pool.used == 16 < held


def test_a_cache_from_outside_enters_the_pool_at_its_length_not_its_reserved_room(tiny_lm) -> None:
    """A cache made outside the pool (a focus pass, a guard's fallback) may hold twice its length in
    room (its own growth doubles). It moves in at its length and grows in the pool: a pool with room
    for what the requests hold, not for what their caches reserved, decodes every row pooled. (It
    asked for the reserved room before: every step of batch_decode_bench's pooled arm went ragged.)"""
    engine = Engine(tiny_lm)
    prompts = _prompts(engine, [40, 33, 50], seed=3, reserve=60)
    caches = [copy.deepcopy(p.cache) for p in prompts]
    assert all(c.capacity >= c.length + 60 for c in caches)
    dec = PooledDecoder(tiny_lm, pool_tokens=sum(c.length for c in caches) + 8 * 16, graphs=False)
    assert dec.pool.capacity < sum(c.capacity for c in caches)
    first = [int(p.logits.argmax()) for p in prompts]
    want, _ = _greedy_run(lambda c, t: decode_batch(tiny_lm, c, t), [copy.deepcopy(p.cache) for p in prompts], first, 6)
    got, _ = _greedy_run(dec.step, caches, first, 6)
    assert got == want
    assert dec.stats.ragged_steps == 0 and dec.stats.eager_steps == 6
    assert all(c.pool is dec.pool for c in caches)


def test_a_request_never_holds_more_than_admission_counted_for_it(tiny_lm) -> None:
    """Admission counts a request's prompt and max_new_tokens, in whole pages over a pool
    (`Engine.request_kv_bytes`); its cache's growth by doubling stops there (`KVCache.most`, set
    as it starts to decode), in a cache of its own and in a run that moves to grow. Before, a
    run that moved took twice its size, past what admission had counted."""
    from ragkv.engine.decode_graphs import DecodeConfig
    from ragkv.engine.kv.cache import KVCache

    ragged, pooled = Engine(tiny_lm), Engine(tiny_lm, decode=DecodeConfig(pool="on", pool_bytes=8 << 20))
    per_token = ragged.kv_bytes_per_token
    assert ragged.request_kv_bytes(100) == 100 * per_token
    assert pooled.request_kv_bytes(100) == 112 * per_token  # 7 pages of 16
    own = KVCache(2, 1, 4, 64, torch.float32, torch.device("cpu"))
    own.most = 80
    own.ensure(65)
    assert own.capacity == 80  # not 128
    from tests.engine.test_shared_pool import _run_at

    pool = pooled.decoder.pool
    cache = pool.new_cache(64)
    cache.length, cache.most = 64, 90
    run = pool.run_of(cache)
    _run_at(pool, run.start + run.size, 16)  # another request's run right after it: it moves to grow
    pool.grow(cache, 65)
    assert pool.moves == 1 and cache.capacity == 96  # its most, in whole pages (not 128)


def test_a_run_of_the_pool_grows_as_its_answer_does_not_at_the_decode_start(tiny_lm) -> None:
    """A request's run holds its prompt and a page, another request's run right after it. Its
    decode starts without asking for room for the answer's start (a cache of its own does): the
    run grows a page at a time as it decodes, and moves (a copy of all its KV, a lent path's too)
    only when its answer outgrows the pages after it. Before, the decode's start moved it at once."""
    from ragkv.engine.decode import SamplingParams
    from ragkv.engine.decode_graphs import DecodeConfig
    from tests.engine.test_shared_pool import _run_at

    engine = Engine(tiny_lm, decode=DecodeConfig(pool="on", pool_bytes=8 << 20))
    pool = engine.decoder.pool
    (res,) = _prompts(engine, [30], seed=4, reserve=1)
    run = pool.run_of(res.cache)
    assert run.size == 32
    _run_at(pool, run.start + run.size, 16)
    stream = engine.decode(res, SamplingParams(max_new_tokens=100))
    assert pool.moves == 0 and stream.cache.capacity == 32
    engine.decoder.step([stream.cache], [int(res.logits.argmax())])  # token 31 of 32: in place
    assert pool.moves == 0 and stream.cache.length == 31
