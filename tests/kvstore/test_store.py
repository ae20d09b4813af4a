"""TieredStore: config parsing, write-through, promotion, prefetch, threads, faults across tiers."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ragkv.errors import StoreError
from ragkv.kvstore import (
    Compression,
    CpuTier,
    DiskTier,
    Policy,
    S3Settings,
    S3Tier,
    StoreConfig,
    Tier,
    TieredStore,
    TierSpec,
    parse_bytes,
)
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry


def test_from_uris_sorts_tiers_and_reads_budgets(tmp_path):
    cfg = StoreConfig.from_uris(
        ["s3://my-bucket/kv/v1", f"disk:{tmp_path}", "cpu"],
        budgets={"cpu": "1GiB", Tier.DISK: 5_000_000},
        policy="hybrid", compression="int8", endpoint_url="http://127.0.0.1:9", region="eu-west-1",
    )
    assert [s.tier for s in cfg.tiers] == [Tier.CPU, Tier.DISK, Tier.S3]
    cpu, disk, s3 = cfg.tiers
    assert (cpu.budget_bytes, cpu.policy) == (2**30, Policy.HYBRID)
    assert (disk.path, disk.budget_bytes) == (str(tmp_path), 5_000_000)
    assert (s3.bucket, s3.prefix, s3.budget_bytes) == ("my-bucket", "kv/v1", None)
    assert cfg.compression is Compression.INT8
    assert (cfg.s3.endpoint_url, cfg.s3.region) == ("http://127.0.0.1:9", "eu-west-1")
    assert cfg.durable_writes == {Tier.DISK, Tier.S3}


@pytest.mark.parametrize(
    "uris, kwargs, match",
    [
        (["tape:/x"], {}, "tape:/x"),
        (["disk:"], {}, "path"),
        (["cpu", "cpu"], {}, "once"),
        ([], {}, "at least one"),
        (["s3://Bad_Bucket/p"], {}, "Bad_Bucket"),
        (["s3://bucket/../etc"], {}, r"\.\./etc"),
        (["cpu"], {"budgets": {"ram": 1}}, "ram"),
        (["cpu"], {"budgets": {"cpu": "lots"}}, "lots"),
        (["cpu", "s3://bucket/p"], {"budgets": {"s3": 1}}, "no byte budget"),
        (["cpu", "disk:/x"], {"write_through": ["cpu"]}, "write_through"),
        (["cpu"], {"compression": "zip"}, "zip"),
        (["cpu"], {"policy": "fifo"}, "fifo"),
    ],
)
def test_bad_specs_are_clear_errors(uris, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StoreConfig.from_uris(uris, **kwargs)


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes(" 1.5 kib ") == 1536
    assert parse_bytes(7) == 7


def _store(tmp_path, s3_settings, bucket, uris=None, **kwargs):
    uris = uris or ["cpu", f"disk:{tmp_path / 'kv'}", f"s3://{bucket}/kv"]
    cfg = StoreConfig.from_uris(uris, s3=s3_settings, **kwargs)
    return TieredStore(cfg, MODEL_FP, TOKENIZER_FP)


def test_put_writes_through_to_every_durable_tier(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket) as store:
        e = make_entry(1)
        store.put(e)
        for tier in (Tier.CPU, Tier.DISK, Tier.S3):
            assert store.tier(tier).contains(e.key), tier
        assert isinstance(store.tier(Tier.DISK), DiskTier)
        assert store.tier(Tier.DISK).path(e.key).is_file()


def test_write_through_only_where_configured(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket, write_through=["disk"]) as store:
        e = make_entry(1)
        store.put(e)
        assert store.tier(Tier.DISK).contains(e.key)
        assert not store.tier(Tier.S3).contains(e.key)


def test_hit_is_promoted_into_every_tier_above(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket, compression="int8") as store:
        e = make_entry(1)
        s3 = store.tier(Tier.S3)
        s3.put(e)  # as if another machine had indexed it
        hit = store.read(e.key)
        assert hit is not None and hit.tier is Tier.S3 and hit.seconds > 0
        assert store.tier(Tier.CPU).contains(e.key) and store.tier(Tier.DISK).contains(e.key)
        # The disk copy is the S3 object's verified bytes, not a second quantization.
        disk_bytes = store.tier(Tier.DISK).path(e.key).read_bytes()
        assert disk_bytes == bytes(s3.read(e.key).data)
        again = store.read(e.key)
        assert again.tier is Tier.CPU
        assert_same(again.entry, hit.entry)
        st = store.stats()
        assert st.promotions == 2 and st.lookups == 2 and st.misses == 0
        assert st.tier(Tier.S3).hits == 2 and st.tier(Tier.CPU).hits == 1  # (one S3 hit was ours above)


def test_memory_tier_owns_what_it_promotes_from_disk(tmp_path):
    """A disk hit views the file's map; the CPU tier must hold its own copy, or an evicted
    file's space would stay allocated for as long as the entry stayed in memory."""
    with TieredStore(StoreConfig.from_uris(["cpu", f"disk:{tmp_path / 'kv'}"]), MODEL_FP, TOKENIZER_FP) as store:
        e = make_entry(1)
        store.tier(Tier.DISK).put(e)
        from_disk = store.tier(Tier.DISK).get(e.key)
        assert not from_disk.k.untyped_storage().resizable()  # a view of the file's bytes
        hit = store.read(e.key)
        held = store.tier(Tier.CPU).get(e.key)
        for name in ("k", "v", "token_ids", "positions"):
            assert getattr(held, name).untyped_storage().resizable(), name  # memory of its own
        assert_same(held, e)
        assert_same(hit.entry, e)


def test_miss_everywhere_is_none_and_counted(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket) as store:
        assert store.read(make_entry(1).key) is None
        st = store.stats()
        assert st.misses == 1 and all(t.misses == 1 for t in st.tiers)


def test_entry_of_another_model_is_refused_by_the_store(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket) as store:
        with pytest.raises(ValueError, match="model-b"):
            store.put(make_entry(1, model_fp="model-b"))


def test_another_models_store_on_the_same_root_sees_nothing(tmp_path):
    root = tmp_path / "kv"
    a = TieredStore(StoreConfig.from_uris([f"disk:{root}"]), MODEL_FP, TOKENIZER_FP)
    e = make_entry(1)
    a.put(e)
    b = TieredStore(StoreConfig.from_uris([f"disk:{root}"]), "model-b", TOKENIZER_FP)
    assert b.read(e.key) is None and b.stats().tier(Tier.DISK).entries == 0
    a.close(), b.close()


def test_prefetch_handles_and_shared_loads(tmp_path, s3_settings, bucket):
    with _store(tmp_path, s3_settings, bucket) as store:
        entries = [make_entry(i) for i in range(4)]
        for e in entries:
            store.tier(Tier.DISK).put(e)
        missing = make_entry(99)
        handles = store.prefetch([entries[0].key, missing.key, entries[0].key, *[e.key for e in entries[1:]]])
        assert [h.key for h in handles][:3] == [entries[0].key, missing.key, entries[0].key]
        results = [None if (hit := h.hit(timeout=30)) is None else hit.entry for h in handles]
        assert results[1] is None
        assert_same(results[0], entries[0])
        assert_same(results[2], entries[0])
        for got, e in zip(results[3:], entries[1:], strict=True):
            assert_same(got, e)
        assert handles[3].hit().tier is Tier.DISK and handles[3].done()
        st = store.stats()
        assert st.prefetches == 6
        assert st.tier(Tier.DISK).hits + st.tier(Tier.CPU).hits + st.prefetch_joined >= 5


def test_concurrent_gets_and_puts_from_threads(tmp_path):
    cfg = StoreConfig.from_uris(["cpu", f"disk:{tmp_path / 'kv'}"], budgets={"cpu": 6 * make_entry(0).nbytes})
    entries = [make_entry(i) for i in range(16)]
    with TieredStore(cfg, MODEL_FP, TOKENIZER_FP) as store:
        for e in entries[:8]:
            store.put(e)
        barrier = threading.Barrier(8)

        def work(worker: int) -> int:
            barrier.wait()
            found = 0
            for round_ in range(20):
                i = (worker * 7 + round_) % len(entries)
                if worker % 4 == 0 and round_ % 5 == 0:
                    store.put(entries[8 + (worker + round_) % 8])
                hit = store.read(entries[i].key)
                got = None if hit is None else hit.entry
                if got is not None:
                    assert_same(got, entries[i])
                    found += 1
            return found

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(work, range(8))) > 0
        st = store.stats()
        assert st.tier(Tier.CPU).bytes_used <= st.tier(Tier.CPU).budget_bytes
        assert st.tier(Tier.DISK).rejected == 0
        for e in entries[:8]:  # the durable copies are all intact
            assert_same(store.tier(Tier.DISK).get(e.key), e)


def test_budget_smaller_than_a_chunk_still_serves_from_below(tmp_path):
    cfg = StoreConfig.from_uris(["cpu", f"disk:{tmp_path / 'kv'}"], budgets={"cpu": 100})
    with TieredStore(cfg, MODEL_FP, TOKENIZER_FP) as store:
        e = make_entry(1)
        store.put(e)
        hit = store.read(e.key)
        assert hit.tier is Tier.DISK
        assert_same(hit.entry, e)
        assert store.stats().tier(Tier.CPU).refused == 2  # the put and the promotion


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_s3_down_loses_nothing_stored_elsewhere(tmp_path):
    dead = S3Settings(endpoint_url=_dead_endpoint(), region="us-east-1", max_attempts=1, connect_timeout_s=1.0)
    cpu = CpuTier(MODEL_FP, TOKENIZER_FP)
    disk = DiskTier(tmp_path / "kv", MODEL_FP, TOKENIZER_FP)
    s3 = S3Tier("bucket-x", "kv", MODEL_FP, TOKENIZER_FP, dead)
    with TieredStore.from_tiers([s3, disk, cpu]) as store:
        e = make_entry(1)
        with pytest.raises(StoreError, match="s3"):
            store.put(e)
        assert cpu.contains(e.key) and disk.contains(e.key)
        assert store.read(make_entry(2).key) is None  # S3 unreachable: a miss, not a crash
        assert store.stats().tier(Tier.S3).errors == 2
        cpu.delete(e.key)
        assert store.read(e.key).tier is Tier.DISK


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_gpu_tier_without_cuda_is_a_clear_error():
    with pytest.raises(StoreError, match="CUDA"):
        TieredStore(StoreConfig.from_uris(["gpu", "cpu"]), MODEL_FP, TOKENIZER_FP)


def test_from_tiers_rejects_mixed_models(tmp_path):
    with pytest.raises(ValueError, match="different"):
        TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP), DiskTier(tmp_path, "model-b", TOKENIZER_FP)])
    with pytest.raises(ValueError, match="once"):
        TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP), CpuTier(MODEL_FP, TOKENIZER_FP)])
    assert TierSpec.parse("disk:///abs").path == "/abs"


def test_a_tier_built_from_the_interface_alone_serves_the_store(tmp_path):
    """The store asks a tier only what StorageTier says (read, take, write, contains, delete,
    stats): a tier written from that interface, of no class the store knows, is read,
    promoted into and written through like a built-in one."""
    from ragkv.kvstore import StorageTier

    class DictDurable(StorageTier):  # a durable tier of its own: a dict, whole reads only
        tier = Tier.S3

        def __init__(self) -> None:
            super().__init__(MODEL_FP, TOKENIZER_FP, None)
            self.held: dict = {}

        def get(self, key):
            return self.held.get(key)

        def put(self, entry):
            self.held[entry.key] = entry
            return True

        def contains(self, key):
            return key in self.held

        def delete(self, key):
            return self.held.pop(key, None) is not None

        def _usage(self):
            return len(self.held), 0

    own = DictDurable()
    store = TieredStore.from_tiers([CpuTier(MODEL_FP, TOKENIZER_FP, None), own])
    try:
        a, b = make_entry(1), make_entry(2)
        own.put(a)
        hit = store.read(a.key, layered=True)  # a tier that cannot stream reads whole
        assert hit is not None and hit.tier is Tier.S3 and hit.layers is None
        assert_same(hit.entry, a)
        assert store.read(a.key).tier is Tier.CPU  # promoted into the memory tier above
        store.put(b)  # written through to it, a durable tier by its Tier
        assert own.contains(b.key)
        [handle] = store.prefetch([b.key])
        assert handle.hit(timeout=10).tier is Tier.CPU
    finally:
        store.close()


def test_held_keys_name_what_each_local_tier_holds_and_leave_s3_out(tmp_path, s3_settings, bucket):
    """What a cluster replica publishes for routing (TieredStore.held_keys): its own tiers'
    keys, never the S3 tier every replica shares."""
    with _store(tmp_path, s3_settings, bucket, write_through=["disk"]) as store:
        on_disk, in_s3 = make_entry(1), make_entry(2)
        store.put(on_disk)  # CPU and disk
        store.tier(Tier.CPU).delete(on_disk.key)  # evicted from memory since
        store.tier(Tier.S3).put(in_s3)
        store.read(in_s3.key)  # promoted into CPU and disk
        held = store.held_keys()
        assert set(held) == {Tier.CPU, Tier.DISK}
        assert set(held[Tier.CPU]) == {in_s3.key}
        assert set(held[Tier.DISK]) == {on_disk.key, in_s3.key}
