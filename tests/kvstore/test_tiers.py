"""One suite, run against every tier (gpu skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from ragkv.kvstore import Compression, Policy, Tier
from ragkv.kvstore.compression import fp8_supported
from tests.kvstore.conftest import ALL_TIERS, assert_same, make_entry

DURABLE = [Tier.DISK, Tier.S3]
BUDGETED = [p for p in ALL_TIERS if p is not Tier.S3]


@pytest.mark.parametrize("tier", ALL_TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(make_tier, tier, dtype):
    t = make_tier(tier)
    e = make_entry(1, dtype=dtype)
    assert t.get(e.key) is None
    assert not t.contains(e.key)
    assert t.put(e)
    assert t.contains(e.key)
    got = t.get(e.key)
    assert got is not None
    assert_same(got, e)
    s = t.stats()
    assert (s.tier, s.hits, s.misses, s.puts) == (tier, 1, 1, 1)
    assert s.bytes_read > 0 and s.bytes_written > 0


@pytest.mark.parametrize("tier", ALL_TIERS)
def test_delete_and_batched_calls(make_tier, tier):
    t = make_tier(tier)
    entries = [make_entry(i) for i in range(3)]
    assert t.put_many(entries) == [True, True, True]
    missing = make_entry(99)
    got = t.get_many([entries[2].key, missing.key, entries[0].key])
    assert got[1] is None
    assert_same(got[0], entries[2])
    assert_same(got[2], entries[0])
    assert t.delete(entries[1].key)
    assert not t.delete(entries[1].key)
    assert t.get(entries[1].key) is None


@pytest.mark.parametrize("tier", ALL_TIERS)
def test_entry_of_another_model_is_refused(make_tier, tier):
    t = make_tier(tier)
    other = make_entry(1, model_fp="model-b")
    with pytest.raises(ValueError, match="model-b"):
        t.put(other)


@pytest.mark.parametrize("tier", DURABLE)
@pytest.mark.parametrize(
    "compression",
    [Compression.INT8, pytest.param(Compression.FP8, marks=pytest.mark.skipif(not fp8_supported(), reason="no fp8"))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compressed_round_trip_within_stated_tolerance(make_tier, tier, compression, dtype):
    t = make_tier(tier, compression=compression)
    e = make_entry(2, dtype=dtype, shape=(2, 2, 16, 8))
    t.put(e)
    got = t.get(e.key)
    assert got is not None and got.k.dtype == dtype and got.k.shape == e.k.shape
    assert torch.equal(got.token_ids, e.token_ids) and torch.equal(got.positions, e.positions)
    for x, y in ((e.k, got.k), (e.v, got.v)):
        x, y = x.float(), y.float()
        amax = x.abs().amax(dim=2, keepdim=True)  # [L, Hkv, 1, D]
        dtype_eps = torch.finfo(dtype).eps * x.abs()  # rounding into the stored dtype
        if compression is Compression.INT8:
            bound = amax / 254 + dtype_eps
        else:
            bound = x.abs() / 16 + amax * 2**-17 + dtype_eps
        err = (y - x).abs()
        assert bool((err <= bound * 1.0001 + 1e-7).all()), f"max excess {(err - bound).max().item()}"
        assert not torch.equal(x, y)  # it really was quantized


@pytest.mark.parametrize("tier", BUDGETED)
def test_budget_smaller_than_one_chunk_refuses_without_losing_anything(make_tier, tier):
    small = make_entry(1)
    big = make_entry(2, shape=(2, 2, 64, 4))
    probe = make_tier(tier, budget_bytes=None)
    probe.put(small)
    small_bytes = probe.stats().bytes_used
    probe.delete(small.key)
    t = make_tier(tier, budget_bytes=small_bytes + 16)
    assert t.put(small)
    assert not t.put(big)  # bigger than the whole budget
    assert t.get(big.key) is None
    assert_same(t.get(small.key), small)  # nothing stored was dropped for it
    s = t.stats()
    assert (s.refused, s.evictions) == (1, 0)
    assert s.bytes_used <= s.budget_bytes


def _fill_and_evict(t, entries, hits):
    for e in entries[:4]:
        assert t.put(e)
    for i in hits:
        assert t.get(entries[i].key) is not None
    assert t.put(entries[4])  # forces one eviction
    return [i for i, e in enumerate(entries[:4]) if not t.contains(e.key)]


@pytest.mark.parametrize("tier", BUDGETED)
@pytest.mark.parametrize(
    "policy, hits, evicted",
    [
        # LRU: entry 0 was hit last-but-one, entry 1 is the oldest untouched.
        (Policy.LRU, [0, 2, 0], [1]),
        # LFU: uses 0:3 1:1 2:2 3:1 -> 1 and 3 tie, 1 is less recent.
        (Policy.LFU, [0, 2, 0], [1]),
        # LFU again: 3 is the only one with one use.
        (Policy.LFU, [0, 1, 2], [3]),
        # One sequence that separates the three policies. After the hits, recency is
        # 0, 1, 2, 3 (oldest first) and uses are 0:4, 1:3, 2:2, 3:2.
        (Policy.LRU, [0, 0, 1, 0, 1, 2, 3], [0]),  # least recent
        (Policy.LFU, [0, 0, 1, 0, 1, 2, 3], [2]),  # fewest uses, 2 and 3 tie, 2 is older
        (Policy.HYBRID, [0, 0, 1, 0, 1, 2, 3], [1]),  # fewest uses in the older half {0, 1}
    ],
)
def test_eviction_order_is_exact(make_tier, tier, policy, hits, evicted):
    entries = [make_entry(10 + i) for i in range(5)]
    probe = make_tier(tier)
    probe.put(entries[0])
    one = probe.stats().bytes_used
    probe.delete(entries[0].key)
    # All entries have one size; a budget of four and a half holds exactly four.
    t = make_tier(tier, budget_bytes=4 * one + one // 2, policy=policy)
    assert _fill_and_evict(t, entries, hits) == evicted
    assert t.stats().evictions == 1
    assert t.contains(entries[4].key)
