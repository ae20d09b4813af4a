"""The storage-tier registry (kvstore/tiers/kinds.py): every kind a store is built from, its place in
the lookup order and its durability, apart from the wire `Tier` enum; a new kind is a `register`
call, with no change to TierSpec, StoreConfig or the wire enum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragkv.kvstore import ChunkKey, KVEntry, StoreConfig, TieredStore, TierSpec, hash_prefix
from ragkv.kvstore.tiers import kinds
from ragkv.kvstore.tiers.memory import CpuTier
from ragkv.types import Tier

FP = "m" * 64
TOK = "t" * 64


def test_the_built_in_kinds_in_lookup_order_and_what_their_specs_take() -> None:
    assert [k.name for k in kinds.kinds()] == ["gpu", "cpu", "disk", "peer", "s3"]
    assert [k.name for k in kinds.kinds(configurable=True)] == ["gpu", "cpu", "disk", "s3"]
    assert {k.name for k in kinds.kinds() if k.durable} == {"disk", "s3"}
    assert all(kinds.kind(k.reports) is k for k in kinds.kinds())  # each built-in reports its own tier
    assert not hasattr(Tier, "rank") and not hasattr(Tier, "durable")  # the wire enum knows no storage
    with pytest.raises(ValueError, match="'nvme' is not a storage tier .*gpu, cpu, disk, peer, s3"):
        kinds.kind("nvme")
    with pytest.raises(ValueError, match="'peer' is not a tier a store is configured with"):
        TierSpec("peer")  # attached by a cluster replica, never configured
    with pytest.raises(ValueError, match="s3 tier has no byte budget"):
        StoreConfig.from_uris(["s3://bucket/kv"], budgets={"s3": "1GiB"})
    with pytest.raises(ValueError, match="is not one of: gpu, cpu, disk:/path, s3://bucket/prefix"):
        TierSpec.parse("nvme:/x")
    with pytest.raises(ValueError, match="a storage tier kind named 'cpu' is registered already"):
        kinds.register(kinds.TierKind("cpu", Tier.CPU, 1, durable=False))


def test_a_new_kind_is_one_register_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host-memory kind of its own ("hostmem", reporting CPU to the client) takes a spec, a
    budget and its place in the order from its registration alone."""
    built: list[str] = []

    def build(spec, config, model_fp, tokenizer_fp):
        built.append(spec.kind)
        return CpuTier(model_fp, tokenizer_fp, spec.budget_bytes, spec.policy)

    monkeypatch.setattr(kinds, "_KINDS", dict(kinds._KINDS))  # registered for this test only
    kinds.register(kinds.TierKind("hostmem", Tier.CPU, 1, durable=False, build=build))
    config = StoreConfig.from_uris([f"disk:{tmp_path}", "hostmem"], budgets={"hostmem": "1MiB"})
    assert [s.kind for s in config.tiers] == ["hostmem", "disk"] and config.tiers[0].budget_bytes == 1 << 20
    assert config.tiers[0].tier is Tier.CPU and config.durable_writes == {Tier.DISK}
    store = TieredStore(config, FP, TOK)
    try:
        assert built == ["hostmem"] and [t.tier for t in store.tiers] == [Tier.CPU, Tier.DISK]
        ids = [5, 6, 7]
        key = ChunkKey.build(FP, TOK, [1, 2], ids)
        kv = torch.randn(2, 1, 3, 4)
        store.put(KVEntry(key, kv, kv.clone(), torch.tensor(ids), torch.arange(2, 5), FP, TOK, hash_prefix([1, 2])))
        assert store.read(key).tier is Tier.CPU  # found in the new kind first, reported as the wire's CPU
    finally:
        store.close()
