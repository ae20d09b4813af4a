"""Layer-ordered reads (kvstore.layered): disk and S3 (moto on loopback) hand an entry out
before its data is read, fill it layer by layer, verify every block, and fail loudly."""

from __future__ import annotations

import threading

import pytest
import torch

from ragkv.errors import KVFormatError, StoreError
from ragkv.kvstore import Compression, StoreConfig, Tier, TieredStore
from ragkv.kvstore.fileformat import data_start, encode
from ragkv.kvstore.layered import LayerGate, read_layered
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry

# 8 layers of 2 x 512 x 64 fp32: 256 KiB of K per layer, so k and v span 2 MiB each (1 MiB blocks)
BIG = (8, 2, 512, 64)


class _Source:
    """Bytes in memory behind a ByteSource; reads past `hold_at` wait until released."""

    def __init__(self, data: bytes, hold_at: int | None = None) -> None:
        self.data, self.size = data, len(data)
        self.hold_at = hold_at
        self.release = threading.Event()
        self.closed = 0
        self.max_read = 0

    def reader(self, start: int, end: int):
        src = self

        class R:
            pos = start

            def readinto(self, view):
                n = min(len(view), end - self.pos, 1 << 18, len(src.data) - self.pos)
                if n <= 0:
                    return 0
                if src.hold_at is not None and self.pos + n > src.hold_at:
                    assert src.release.wait(10)
                view[:n] = src.data[self.pos:self.pos + n]
                self.pos += n
                src.max_read = max(src.max_read, self.pos)
                return n
        return R()

    def close(self):
        self.closed += 1


def _read(source, **kw):
    done, failed = [], []
    threads = []

    def spawn(fn):
        t = threading.Thread(target=fn)
        threads.append(t)
        t.start()

    entry, gate = read_layered(source, expected_key=kw.pop("key"), model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP,
                               spawn=spawn, on_done=lambda data, e: done.append(bytes(data)),
                               on_fail=failed.append)
    return entry, gate, done, failed, threads


def test_layers_become_readable_in_order_before_the_file_is_whole():
    e = make_entry(1, shape=BIG)
    data = encode(e)
    layout_k_end = data_start(data) + e.k.nbytes + 2 * e.token_ids.nbytes  # k ends where v starts
    src = _Source(data, hold_at=len(data) - 1000)  # stall in the last block
    entry, gate, done, failed, threads = _read(src, key=e.key)
    gate.wait(2, timeout=10)  # the first layers are there while the read is held
    assert not done and gate.ready < BIG[0]
    assert src.max_read < len(data)
    for layer in range(gate.ready):
        assert torch.equal(entry.k[layer], e.k[layer]) and torch.equal(entry.v[layer], e.v[layer])
    with pytest.raises(TimeoutError):
        gate.wait(BIG[0] - 1, timeout=0.05)
    src.release.set()
    gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert_same(entry, e)
    assert done == [data] and not failed and src.closed == 1
    assert layout_k_end < len(data)


def test_a_latent_stored_once_streams_by_layer_with_v_as_k():
    """A file holding one latent as k and v (MLA, `v_is_k`) streams k's layers and hands v = k."""
    import dataclasses

    e = make_entry(4, shape=BIG)
    e = dataclasses.replace(e, v=e.k)
    data = encode(e)
    assert len(data) < data_start(data) + e.k.nbytes + 2 * e.token_ids.nbytes + 1
    src = _Source(data, hold_at=len(data) - 1000)  # stall in the last block: the last layer of k
    entry, gate, done, failed, threads = _read(src, key=e.key)
    gate.wait(2, timeout=10)
    assert not done and gate.ready < BIG[0] and entry.v is entry.k
    assert torch.equal(entry.k[:gate.ready], e.k[:gate.ready])
    src.release.set()
    gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert torch.equal(entry.k, e.k) and entry.v is entry.k and done == [data] and not failed


def test_a_damaged_late_block_fails_its_layer_and_the_rest_but_not_the_earlier_ones():
    e = make_entry(2, shape=BIG)
    data = bytearray(encode(e))
    data[-10] ^= 0xFF  # the last block of v: the last layer
    entry, gate, done, failed, threads = _read(_Source(bytes(data)), key=e.key)
    gate.wait(0, timeout=10)  # layer 0 sits in blocks that pass
    with pytest.raises(KVFormatError, match="checksum mismatch"):
        gate.wait(BIG[0] - 1, timeout=10)
    for t in threads:
        t.join()
    assert not done and len(failed) == 1 and isinstance(gate.error, KVFormatError)


def test_a_bad_header_raises_before_anything_is_handed_out():
    e = make_entry(3, shape=BIG)
    src = _Source(encode(e))
    with pytest.raises(KVFormatError, match="expected"):
        _read(src, key=make_entry(4).key)
    assert src.closed == 1


def test_a_compressed_file_reads_to_the_end_within_tolerance():
    """(Streaming of compressed files layer by layer: tests/kvstore/test_compression.py.)"""
    e = make_entry(5, shape=BIG)
    entry, gate, done, failed, threads = _read(_Source(encode(e, Compression.INT8)), key=e.key)
    gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert len(done) == 1 and not failed
    assert torch.allclose(entry.k, e.k, atol=0.05)


def test_a_truncated_file_fails_the_gate():
    e = make_entry(6, shape=BIG)
    data = encode(e)
    src = _Source(data)
    src.size = len(data)  # the header promises it all, the reads stop short
    src.data = data[: len(data) - 4096]
    entry, gate, done, failed, threads = _read(src, key=e.key)
    with pytest.raises(KVFormatError, match="ended at byte"):
        gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert not done


def test_gate_refuses_layers_it_does_not_have():
    gate = LayerGate(3)
    with pytest.raises(IndexError):
        gate.wait(3)
    LayerGate.complete(3).wait(2, timeout=0)


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.S3])
def test_store_layered_hit_equals_the_whole_read_and_promotes_when_done(tier, make_tier):
    lower = make_tier(tier)
    cpu = make_tier(Tier.CPU)
    store = TieredStore.from_tiers([cpu, lower])
    e = make_entry(7, shape=BIG)
    lower.put(e)
    [handle] = store.prefetch([e.key], layered=True)
    hit = handle.hit(timeout=30)
    assert hit is not None and hit.tier is tier and hit.layers is not None
    hit.layers.wait_all(timeout=30)
    assert_same(hit.entry, e)
    store.close()  # waits for the read's tail, which promotes
    assert cpu.contains(e.key)
    assert store.stats().tier(tier).hits == 1


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.S3])
def test_store_layered_read_of_a_damaged_file_fails_and_takes_the_copy_out(tier, make_tier, s3_client):
    lower = make_tier(tier)
    store = TieredStore.from_tiers([lower])
    e = make_entry(8, shape=BIG)
    lower.put(e)
    if tier is Tier.DISK:
        path = lower.path(e.key)
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(raw)
    else:
        name = lower.object_key(e.key)
        raw = bytearray(s3_client.get_object(Bucket=lower.bucket, Key=name)["Body"].read())
        raw[-10] ^= 0xFF
        s3_client.put_object(Bucket=lower.bucket, Key=name, Body=bytes(raw))
    hit = store.read(e.key, layered=True)
    assert hit is not None
    with pytest.raises(KVFormatError):
        hit.layers.wait_all(timeout=30)
    store.close()
    assert lower.stats().rejected == 1
    assert not lower.contains(e.key)  # quarantined (disk) or deleted (s3)


def test_store_layered_miss_and_memory_hit(make_tier, tmp_path):
    store = TieredStore(StoreConfig.from_uris(["cpu", f"disk:{tmp_path}/kv"]), MODEL_FP, TOKENIZER_FP)
    e = make_entry(9)
    assert store.read(e.key, layered=True) is None
    store.put(e)
    hit = store.read(e.key, layered=True)
    assert hit.tier is Tier.CPU and hit.layers is None
    assert_same(hit.entry, e)
    store.close()


def test_a_read_error_mid_file_is_a_store_error_not_damage():
    e = make_entry(10, shape=BIG)
    src = _Source(encode(e))
    real = src.reader

    def failing(start, end):
        r = real(start, end)
        if start > 1 << 20:
            r.readinto = lambda view: (_ for _ in ()).throw(OSError("device gone"))
        return r
    src.reader = failing
    entry, gate, done, failed, threads = _read(src, key=e.key)
    with pytest.raises(StoreError, match="device gone"):
        gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert isinstance(failed[0], StoreError) and src.closed == 1
