"""The chunk file: safetensors-compatible, and every kind of damage is caught before tensors leave."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch

from ragkv.errors import KVFormatError
from ragkv.kvstore import FORMAT_VERSION, Compression
from ragkv.kvstore.fileformat import decode, encode, read_header
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry


def _decode(data, key):
    return decode(bytearray(data), expected_key=key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP)


def test_file_is_plain_safetensors_with_the_documented_header():
    e = make_entry(1, dtype=torch.float16)
    data = encode(e)
    tensors = safetensors.torch.load(data)
    assert sorted(tensors) == ["k", "positions", "token_ids", "v"]
    assert torch.equal(tensors["k"], e.k) and tensors["token_ids"].dtype == torch.int64
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    assert {k: meta[k] for k in ("format_version", "model_fp", "tokenizer_fp", "dtype", "shape", "rope_mode", "compression")} == {
        "format_version": str(FORMAT_VERSION), "model_fp": MODEL_FP, "tokenizer_fp": TOKENIZER_FP,
        "dtype": "float16", "shape": "2,2,8,4", "rope_mode": "pre_rope", "compression": "none",
    }
    assert meta["prefix_hash"] == e.prefix_hash and meta["key"] == e.key.hex
    assert meta["checksum"].startswith("crc32c:")
    assert read_header(data).key == e.key


def test_decoded_tensors_view_the_read_buffer():
    e = make_entry(1)
    buf = bytearray(encode(e))
    got = decode(buf, expected_key=e.key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP)
    assert_same(got, e)
    lo = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert lo <= got.k.data_ptr() < lo + len(buf)  # no copy


@pytest.mark.parametrize("cut", [0, 7, 8, 100, -1, -200])
def test_truncated_file_is_rejected(cut):
    e = make_entry(1)
    data = encode(e)
    with pytest.raises(KVFormatError):
        _decode(data[:cut], e.key)


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.INT8, Compression.INT4])
def test_every_single_flipped_bit_is_caught_or_harmless(compression):
    """Flip one bit at many offsets: each decode raises, or (JSON whitespace) returns the exact entry."""
    e = make_entry(3)
    data = encode(e, compression)
    reference = _decode(data, e.key)
    for offset in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[offset] ^= 1 << (offset % 8)
        try:
            got = _decode(damaged, e.key)
        except KVFormatError:
            continue
        assert_same(got, reference)


def test_file_of_another_model_is_rejected():
    other = make_entry(1, model_fp="model-b")
    with pytest.raises(KVFormatError, match="model-b"):
        decode(bytearray(encode(other)), expected_key=other.key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP)
    other_tok = make_entry(1, tokenizer_fp="tok-b")
    with pytest.raises(KVFormatError, match="tok-b"):
        decode(bytearray(encode(other_tok)), expected_key=other_tok.key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP)


def test_file_under_another_key_is_rejected():
    a, b = make_entry(1), make_entry(2)
    with pytest.raises(KVFormatError, match="expected"):
        _decode(encode(a), b.key)


def test_metadata_edited_consistently_still_fails_the_checksum():
    """Rewrite one hex digit of the prefix hash (still valid JSON and metadata): the checksum catches it."""
    e = make_entry(1)
    data = bytearray(encode(e))
    old = e.prefix_hash.encode()
    new = old[:-1] + (b"0" if old[-1:] != b"0" else b"1")
    at = bytes(data).index(old)
    data[at : at + len(old)] = new
    with pytest.raises(KVFormatError, match="checksum"):
        _decode(data, e.key)


def test_random_bytes_and_foreign_safetensors_are_rejected():
    e = make_entry(1)
    with pytest.raises(KVFormatError):
        _decode(b"\x00" * 64, e.key)
    foreign = safetensors.torch.save({"k": torch.zeros(2)}, metadata={"format": "pt"})
    with pytest.raises(KVFormatError, match="format"):
        _decode(foreign, e.key)


def test_bytes_per_token_fp16_vs_int8():
    """SmolLM2 shape: fp16 = 2*30*3*64*2 = 23,040 B/token of K/V; int8 about half."""
    shape = (30, 3, 64, 64)  # [L, Hkv, T, D]
    e = make_entry(1, shape=shape, dtype=torch.float16)
    per_token = {c: len(encode(e, c)) / shape[2] for c in (Compression.NONE, Compression.INT8)}
    kv_fp16 = 2 * 30 * 3 * 64 * 2
    assert kv_fp16 == 23_040
    assert kv_fp16 < per_token[Compression.NONE] < kv_fp16 + 16 + 4096 / shape[2]  # ids + header
    # int8 values are half; the float32 scales are a per-chunk cost (T=64 here).
    assert per_token[Compression.INT8] < 0.5 * per_token[Compression.NONE] + 2 * 30 * 3 * 64 * 4 / shape[2] + 64


def _big_entry():
    """An entry whose data section spans several checksum blocks (3.x MiB with 1 MiB blocks)."""
    return make_entry(5, shape=(4, 4, 256, 64), dtype=torch.float32)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_bit_in_any_checksum_block_is_caught(where, tmp_path):
    from ragkv.kvstore import DiskTier
    from ragkv.kvstore.fileformat import CHECKSUM_BLOCK_BYTES, data_start

    e = _big_entry()
    data = bytearray(encode(e))
    base = data_start(data)
    n_blocks = -(-(len(data) - base) // CHECKSUM_BLOCK_BYTES)
    assert n_blocks >= 3
    block = {"first": 0, "middle": n_blocks // 2, "last": n_blocks - 1}[where]
    at = min(len(data) - 1, base + block * CHECKSUM_BLOCK_BYTES + 12345)
    data[at] ^= 0x10
    with pytest.raises(KVFormatError, match=f"checksum mismatch .* block {block} of {n_blocks}"):
        _decode(data, e.key)
    # The disk tier, which checksums blocks while it reads, catches it too.
    disk = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP)
    assert disk.put(e) and disk.get(e.key) is not None
    disk.path(e.key).write_bytes(bytes(data))
    assert disk.get(e.key) is None


def test_old_format_file_is_a_clean_miss_not_corruption(tmp_path, caplog):
    """A genuine version-1 file (one CRC over all data): refused as another format version."""
    import zlib

    from ragkv.kvstore import DiskTier
    from ragkv.kvstore.fileformat import _header_checksum, _parse_layout

    e = make_entry(1)
    meta, layout = _parse_layout(memoryview(encode(e)))
    tensors = safetensors.torch.load(encode(e))
    blob = encode(e)
    data = blob[8 + struct.unpack("<Q", blob[:8])[0]:]
    meta = {k: v for k, v in meta.items() if k != "checksum_block"}
    meta["format_version"] = "1"
    meta["checksum"] = f"crc32:{zlib.crc32(data):08x}"
    meta["header_checksum"] = _header_checksum(meta, layout)
    header = {"__metadata__": meta}
    for name, (dt, shape, s, end) in layout.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [s, end]}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    old = struct.pack("<Q", len(hb)) + hb + data
    assert sorted(safetensors.torch.load(old)) == sorted(tensors)  # still a valid safetensors file
    with pytest.raises(KVFormatError, match="format version '1'") as err:
        _decode(old, e.key)
    assert "checksum" not in str(err.value)
    disk = DiskTier(tmp_path, MODEL_FP, TOKENIZER_FP)
    disk.path(e.key).parent.mkdir(parents=True, exist_ok=True)
    disk.path(e.key).write_bytes(old)
    with caplog.at_level("WARNING"):
        assert disk.get(e.key) is None
    assert "format version" in caplog.text and "checksum mismatch" not in caplog.text


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.INT8])
def test_a_latent_held_as_both_k_and_v_is_written_once(compression):
    """Multi-head latent attention caches one latent as K and as V: the file holds it once
    (V's bytes saved), says so in its checksummed header, and reads back v = k."""
    import dataclasses

    e = make_entry(3, dtype=torch.float16)
    both = dataclasses.replace(e, v=e.k.clone())  # equal values, another tensor (as the engine computes them)
    data, plain = encode(both, compression), encode(e, compression)
    tensors = safetensors.torch.load(data)
    assert "v" not in tensors and "v_q" not in tensors and "v_packed" not in tensors
    v_bytes = e.v.numel() * (1 if compression is Compression.INT8 else e.v.element_size())
    assert len(plain) - len(data) >= v_bytes
    got = _decode(data, e.key)
    assert got.v is got.k and torch.allclose(got.k.float(), e.k.float(), atol=0.05)
    assert got.nbytes < e.nbytes
    # the flag is under the header checksum: dropping it is corruption, not a silent v = k
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].pop("v_is_k")
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with pytest.raises(KVFormatError):
        _decode(struct.pack("<Q", len(blob)) + blob + data[8 + n:], e.key)
