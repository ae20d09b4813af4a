"""KV compression (kvstore.compression): every format's round trip within its stated tolerance,
its bytes, corrupt-file detection, mixed formats in one store, and layered reads of
compressed files (dequantized layer by layer, equal to the whole read)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ragkv.errors import KVFormatError
from ragkv.kvstore import Compression, DiskTier, Tier, TieredStore
from ragkv.kvstore.compression import (
    KEY_GROUP,
    VALUE_GROUP,
    fp8_supported,
    layer_parts,
    pack,
    stored_bytes_per_token,
    unpack,
)
from ragkv.kvstore.fileformat import decode, encode, read_header
from ragkv.kvstore.layered import read_layered
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, make_entry
from tests.kvstore.test_layered import _Source

KIVI = [Compression.INT4, Compression.INT2]
PACKED = [Compression.INT8, pytest.param(Compression.FP8, marks=pytest.mark.skipif(not fp8_supported(),
                                                                                   reason="no fp8")), *KIVI]
# 8 layers of 4 heads x 1024 tokens x 128 lanes: int4 K and V are ~2.6 MB each, so each
# stream spans several 1 MiB checksum blocks and a read can be held mid-file
STREAM = (8, 4, 1024, 128)


def _decode(data: bytes) -> object:
    return decode(bytearray(data), expected_key=read_header(data).key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP)


def _kivi_bound(x: torch.Tensor, role: str, bits: int) -> torch.Tensor:
    """The stated INT4/INT2 tolerance per element of x `[L, Hkv, T, D]` (kvstore.compression)."""
    n_layers, hkv, t, d = x.shape
    q = (1 << bits) - 1
    if role == "k":
        tp = -(-t // KEY_GROUP) * KEY_GROUP
        padded = torch.cat([x, x[:, :, -1:].expand(-1, -1, tp - t, -1)], dim=2)  # [L, Hkv, Tp, D]
        g = padded.reshape(n_layers, hkv, tp // KEY_GROUP, KEY_GROUP, d)
        lo = g.amin(3).repeat_interleave(KEY_GROUP, 2)[:, :, :t]  # [L, Hkv, T, D]
        hi = g.amax(3).repeat_interleave(KEY_GROUP, 2)[:, :, :t]
    else:
        gs = VALUE_GROUP if d % VALUE_GROUP == 0 else d
        g = x.reshape(n_layers, hkv, t, d // gs, gs)
        lo, hi = g.amin(4).repeat_interleave(gs, 3), g.amax(4).repeat_interleave(gs, 3)  # [L, Hkv, T, D]
    s = (hi - lo) / q
    return s / 2 + 2**-10 * (lo.abs() + q * s)


@pytest.mark.parametrize("compression", KIVI)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kivi_round_trip_within_stated_tolerance(tmp_path, compression, dtype):
    tier = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None, compression=compression)
    e = make_entry(2, dtype=dtype, shape=(2, 2, 70, 64))  # 70 tokens: a partial key group
    e.k.view(-1)[::64].mul_(30)  # an outlier lane in every head: keys are quantized per channel
    tier.put(e)
    got = tier.get(e.key)
    assert got is not None and got.k.dtype == dtype and got.k.shape == e.k.shape
    bits = 4 if compression is Compression.INT4 else 2
    for role, x, y in (("k", e.k, got.k), ("v", e.v, got.v)):
        x, y = x.float(), y.float()
        bound = _kivi_bound(x, role, bits) + torch.finfo(dtype).eps * x.abs()
        err = (y - x).abs()
        assert bool((err <= bound * 1.0001 + 1e-6).all()), f"{role}: max excess {(err - bound).max().item()}"
        assert not torch.equal(x, y)


@pytest.mark.parametrize("compression", PACKED)
@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (2, 2, 45, 64), (1, 1, 7, 16)])  # keys' last group short too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_in_one_pass_into_a_layer_gives_the_widened_arithmetic(compression, shape, dtype):
    """Codes widen inside the one pass that scales them and writes the caller's tensor (a layered
    read's layer): the same bits as widening to float32 first, then scaling, then casting."""
    x = torch.randn(*shape) * 3
    for role in ("k", "v"):
        rows = pack(x, compression, role)
        n, b = rows.shape
        views = {}
        for p in layer_parts(compression, role, *shape[1:]):
            views[p.name] = rows[:, p.start:p.start + p.nbytes].view(p.dtype).reshape(n, *p.shape)
        codes = views["codes"]
        if compression in KIVI:
            bits = 4 if compression is Compression.INT4 else 2
            shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
            codes = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(n, *shape[1:]).float()
            scale, mn = views["scale"].float(), views["min"].float()
            if role == "k":
                scale = scale.repeat_interleave(KEY_GROUP, dim=2)[:, :, :shape[2]]
                mn = mn.repeat_interleave(KEY_GROUP, dim=2)[:, :, :shape[2]]
            else:
                g = VALUE_GROUP if shape[3] % VALUE_GROUP == 0 else shape[3]
                scale, mn = scale.repeat_interleave(g, dim=-1), mn.repeat_interleave(g, dim=-1)
            widened = (mn + codes * scale).to(dtype)
        else:
            widened = (codes.float() * views["scale"]).to(dtype)
        into = torch.full(shape, float("nan"), dtype=dtype)
        for layer in range(n):  # one layer at a time, as a layered read writes them
            unpack(rows[layer:layer + 1], compression, role, shape[1:], dtype, out=into[layer:layer + 1])
        assert torch.equal(into, widened)
        assert torch.equal(unpack(rows, compression, role, shape[1:], dtype), widened)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        unpack(rows, compression, "v", shape[1:], dtype, out=torch.empty(shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        unpack(rows, compression, "v", shape[1:], dtype, out=torch.empty(shape, dtype=dtype).transpose(2, 3))


def test_four_bits_beat_two_and_eight_beat_four():
    x = make_entry(3, shape=(2, 2, 128, 64)).k
    err = {c: (unpack(pack(x, c, "k"), c, "k", (2, 128, 64), torch.float32) - x).pow(2).mean().item()
           for c in (Compression.INT8, *KIVI)}
    assert err[Compression.INT8] < err[Compression.INT4] / 10 < err[Compression.INT2] / 100


def test_bytes_per_token_for_smollm2():
    """SmolLM2-135M (30 layers, 3 KV heads, head dim 64), 256-token chunks: bf16 is 23,040 B/token."""
    shape = (30, 3, 256, 64)
    got = {c: stored_bytes_per_token(c, shape) for c in Compression}
    assert got == {Compression.NONE: 23040, Compression.INT8: 11700, Compression.FP8: 11700,
                   Compression.INT4: 7200, Compression.INT2: 4320}
    e = make_entry(4, shape=shape, dtype=torch.bfloat16)
    for c in (Compression.NONE, Compression.INT8, Compression.INT4, Compression.INT2):
        file_per_token = len(encode(e, c)) / shape[2]
        assert got[c] < file_per_token < got[c] + 16 + 16384 / shape[2]  # + ids, positions and the header


@pytest.mark.parametrize("compression", KIVI)
def test_every_flipped_bit_of_a_kivi_file_is_caught_or_harmless(compression):
    e = make_entry(5, shape=(2, 2, 40, 8))
    data = encode(e, compression)
    reference = _decode(data)
    for offset in range(0, len(data), 5):
        damaged = bytearray(data)
        damaged[offset] ^= 1 << (offset % 8)
        try:
            got = _decode(bytes(damaged))
        except KVFormatError:
            continue
        assert torch.equal(got.k, reference.k) and torch.equal(got.v, reference.v)


def test_a_truncated_or_reshaped_kivi_file_is_rejected():
    e = make_entry(6, shape=(2, 2, 40, 8))
    data = encode(e, Compression.INT4)
    with pytest.raises(KVFormatError):
        _decode(data[:-100])


def test_one_store_holds_int8_and_int4_files_side_by_side(tmp_path):
    """Two writers of one folder with different formats; one store reads both, each file says its own."""
    a, b, c = make_entry(7), make_entry(8), make_entry(9)
    DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None, compression=Compression.INT8).put(a)
    DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None, compression=Compression.INT4).put(b)
    DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None).put(c)
    reader = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None, compression=Compression.INT2)
    formats = {e.key: read_header(reader.path(e.key).read_bytes()).compression for e in (a, b, c)}
    assert formats == {a.key: Compression.INT8, b.key: Compression.INT4, c.key: Compression.NONE}
    with TieredStore.from_tiers([reader]) as store:
        for e, tol in ((a, 0.05), (b, 0.5), (c, 0.0)):
            for layered in (False, True):
                hit = store.read(e.key, layered=layered)
                assert hit is not None and hit.tier is Tier.DISK
                if hit.layers is not None:
                    hit.layers.wait_all(timeout=10)
                assert torch.allclose(hit.entry.k, e.k, atol=tol) and torch.allclose(hit.entry.v, e.v, atol=tol)


def _layered(data: bytes, hold_at: int | None = None, device: torch.device | None = None):
    src = _Source(data, hold_at=hold_at)
    done, failed, threads = [], [], []

    def spawn(fn):
        t = threading.Thread(target=fn)
        threads.append(t)
        t.start()

    entry, gate = read_layered(src, expected_key=read_header(data).key,
                               model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP, spawn=spawn,
                               on_done=lambda buf, whole: done.append(whole), on_fail=failed.append, device=device)
    return src, entry, gate, done, failed, threads


@pytest.mark.parametrize("compression", PACKED)
def test_a_compressed_file_streams_layer_by_layer_and_equals_the_whole_read(compression):
    e = make_entry(10, shape=STREAM, dtype=torch.bfloat16)
    data = encode(e, compression)
    whole = _decode(data)
    src, entry, gate, done, failed, threads = _layered(data, hold_at=len(data) - 1000)  # stall in v's last block
    deadline = time.monotonic() + 10
    while gate.ready < 2 and time.monotonic() < deadline:  # verified by the reader, nobody has waited yet
        time.sleep(0.01)
    assert 2 <= gate.ready < STREAM[0] and src.max_read < len(data) and not done
    assert not torch.equal(entry.k[1], whole.k[1])  # the reading thread does not dequantize
    assert entry.k.dtype == torch.bfloat16
    for layer in range(gate.ready):  # a waiter dequantizes what it waits on, on its own thread
        gate.wait(layer, timeout=10)
        assert torch.equal(entry.k[layer], whole.k[layer]) and torch.equal(entry.v[layer], whole.v[layer])
    src.release.set()
    for t in threads:
        t.join()
    assert not done and not gate.when_filled().done()  # verified, not yet all dequantized: not handed on
    gate.wait_all(timeout=10)
    assert torch.equal(entry.k, whole.k) and torch.equal(entry.v, whole.v) and not failed
    for t in threads[1:]:  # the hand-on, spawned by the waiter that dequantized the last layer
        t.join()
    assert len(done) == 1 and gate.when_filled().done()


def test_a_damaged_block_of_a_compressed_file_fails_its_layer_and_the_rest():
    e = make_entry(11, shape=STREAM, dtype=torch.bfloat16)
    data = bytearray(encode(e, Compression.INT4))
    data[-10] ^= 0xFF  # v's last block: the last layers
    src, entry, gate, done, failed, threads = _layered(bytes(data))
    gate.wait(0, timeout=10)
    with pytest.raises(KVFormatError, match="checksum mismatch"):
        gate.wait(STREAM[0] - 1, timeout=10)
    for t in threads:
        t.join()
    assert not done and len(failed) == 1


def test_a_latent_stored_once_streams_compressed_with_v_as_k():
    import dataclasses

    e = make_entry(12, shape=STREAM, dtype=torch.bfloat16)
    e = dataclasses.replace(e, v=e.k)
    data = encode(e, Compression.INT4)
    src, entry, gate, done, failed, threads = _layered(data)
    gate.wait_all(timeout=10)
    for t in threads:
        t.join()
    assert entry.v is entry.k and torch.equal(entry.k, _decode(data).k) and not failed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compression", [Compression.INT8, *KIVI])
def test_compressed_layers_dequantize_on_the_engines_device(compression):
    e = make_entry(13, shape=STREAM, dtype=torch.bfloat16)
    data = encode(e, compression)
    src, entry, gate, done, failed, threads = _layered(data, device=torch.device("cuda"))
    gate.wait_all(timeout=30)
    for t in threads:
        t.join()
    assert entry.k.device.type == "cuda" and entry.v.device.type == "cuda"
    whole = _decode(data)
    torch.testing.assert_close(entry.k.cpu(), whole.k, rtol=0, atol=1e-2)
    torch.testing.assert_close(entry.v.cpu(), whole.v, rtol=0, atol=1e-2)


def test_the_read_estimate_counts_stored_bytes_and_dequantization(tmp_path):
    e = make_entry(14, shape=(8, 4, 256, 64), dtype=torch.bfloat16)
    tier = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP, None, compression=Compression.INT4)
    tier.put(e)
    size = tier.path(e.key).stat().st_size
    with TieredStore.from_tiers([tier]) as store:
        assert store.read(e.key) is not None
        est = store.read_estimate(Tier.DISK)
    assert est is not None and est.bytes_per_token == pytest.approx(size / 256)
    assert size < e.nbytes / 3  # the file's bytes, not the dequantized entry's
    assert est.dequant_s_per_token > 0
    assert est.seconds(256) > est.latency_s + 256 * est.bytes_per_token / est.bytes_per_s


def test_an_int8_file_written_before_packed_rows_still_reads() -> None:
    """Nothing stored is lost: an index's int8 files of the earlier layout (`k_q`/`k_scale`,
    written by the encoder of before the packed rows) read as they did."""
    from pathlib import Path

    from ragkv.kvstore import ChunkKey, hash_prefix
    from ragkv.kvstore.compression import dequantize, quantize
    from ragkv.kvstore.fileformat import decode

    data = (Path(__file__).parent / "data" / "int8_before_packed_rows.kv").read_bytes()
    g = torch.Generator().manual_seed(56)  # the tensors the file was written from
    k, v = torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 1, 4, 8, generator=g)
    key = ChunkKey.from_prefix_hash("model-a", "tok-a", hash_prefix([1, 2]), [5, 6, 7, 8])
    entry = decode(bytearray(data), expected_key=key, model_fp="model-a", tokenizer_fp="tok-a")
    for got, x in ((entry.k, k), (entry.v, v)):
        assert torch.equal(got, dequantize(*quantize(x, Compression.INT8), torch.float32))
        assert (got - x).abs().max().item() <= x.abs().amax(dim=2, keepdim=True).max().item() / 127
    assert entry.token_ids.tolist() == [5, 6, 7, 8] and entry.positions.tolist() == [2, 3, 4, 5]
