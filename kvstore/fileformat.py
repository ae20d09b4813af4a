"""The chunk KV file: one safetensors file per chunk, verified before any tensor is handed out.

Tensors: `k`, `v` `[L, Hkv, T, D]` (or, compressed, `k_packed`, `v_packed` `[L, B]` uint8:
one row of every byte of a layer, scales and codes, `kvstore.compression.pack`; files of
before issue 56 hold `k_q`/`k_scale`, `v_q`/`v_scale` and are still read),
`token_ids` `[T]` int64 and `positions` `[T]` int64. Header metadata (all strings):
format, format_version, key, model_fp, tokenizer_fp, prefix_hash (and context_hash, only for a chunk
prefilled after context: neighbour-conditioned KV), rope_mode, dtype,
compression, shape ("L,Hkv,T,D"), checksum_block, checksum and header_checksum.
A chunk whose V equals its K bit for bit (multi-head latent attention caches one latent
as both) is written with `k` only and `v_is_k` = "true"; reading gives v = k.

`checksum` is "crc32c:" and a comma-separated list of CRC-32Cs, one per fixed block
of `checksum_block` bytes of the data section (the tensor bytes, in file order;
the last block may be shorter). Every byte of the data is in exactly one block, so
the check is as strong per byte as one CRC over the whole, and the blocks are
verified on a small thread pool (the `crc32c` package releases the GIL on large
buffers), which roughly divides the verify time by the number of cores. CRC-32C
(Castagnoli) runs on the CPU's own instruction (SSE 4.2, ARMv8): 12 GB/s a core here
against zlib CRC-32's 2.2, so verifying a 4K-token prompt's 189 MB of KV takes 16 ms
instead of 87, and a layered read steals that much less from the compute it overlaps.
`header_checksum` covers the metadata (less both checksums, so `checksum_block` and
the block count are covered) and every tensor's name, dtype, shape and offsets.
CRC-32C catches the faults a store meets (truncation, flipped bits, torn writes) at
memory speed; it is no defence against a forger.

The writer here lays tensors out as the safetensors library does (widest dtype
first, then by name; header padded to 8 bytes) and the library reads our files
(a test checks). Reading parses the header here so the tensors are views of the
one buffer the bytes were read into (no copy).
Any mismatch raises KVFormatError; the tiers turn that into a counted miss.

Knows nothing of where the bytes live.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import torch

from ragkv.errors import KVFormatError
from ragkv.kvstore.compression import (
    Compression,
    DequantClock,
    check_supported,
    dequantize,
    pack,
    row_bytes,
    unpack,
)
from ragkv.kvstore.entry import KVEntry, RopeMode
from ragkv.kvstore.keys import FORMAT_VERSION, ChunkKey, ContextHash, check_prefix_hash

FORMAT_NAME = "ragkv-chunk-kv"
CHECKSUM_ALGO = "crc32c"
_CHECKSUM_FIELDS = ("checksum", "header_checksum")
MAX_HEADER_BYTES = 1 << 20  # our headers are ~1-2 KB; anything larger is not ours
CHECKSUM_BLOCK_BYTES = 1 << 20  # 1 MiB: ~12 blocks per SmolLM2 chunk of 512 tokens, so 2+ threads balance
_MIN_BLOCK_BYTES = 1 << 16  # smallest block size a file may declare (bounds the header's CRC list)
_MAX_BLOCK_BYTES = 1 << 30
_MAX_VERIFY_THREADS = 4

_ST_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
}
if hasattr(torch, "float8_e4m3fn"):
    _ST_DTYPES["F8_E4M3"] = torch.float8_e4m3fn
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

_TORCH_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class FileHeader:
    """What a file's metadata says, parsed and checked for shape, before any tensor is built."""

    key: ChunkKey  # the key the file claims to hold
    model_fp: str  # model fingerprint recorded at write time
    tokenizer_fp: str  # tokenizer fingerprint recorded at write time
    compression: Compression  # how k and v are stored
    dtype: torch.dtype  # dtype of k and v once decoded
    shape: tuple[int, int, int, int]  # (L, Hkv, T, D)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy when it is contiguous."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    return flat.numpy().data  # the array's buffer (memoryview(array) reads the same one)


def _header_checksum(meta: Mapping[str, str], layout: Mapping[str, tuple[str, tuple[int, ...], int, int]]) -> str:
    """CRC-32C over canonical metadata (less checksums) and each tensor's dtype, shape and data offsets."""
    body = {
        "metadata": {k: v for k, v in meta.items() if k not in _CHECKSUM_FIELDS},
        "tensors": {name: [dt, list(shape), s, e] for name, (dt, shape, s, e) in layout.items()},
    }
    crc = block_crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return f"{CHECKSUM_ALGO}:{crc:08x}"


def block_crc(data: memoryview | bytes | bytearray, crc: int = 0) -> int:
    """Running CRC-32C of `data` continuing from `crc` (the file format's one checksum)."""
    return crc32c.crc32c(data, crc)


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool): remade after a fork


def _verify_threads() -> int:
    return max(1, min(_MAX_VERIFY_THREADS, os.cpu_count() or 1))


def _crc_pool() -> ThreadPoolExecutor:
    """The process's checksum helpers (one fewer than the threads used: the caller takes a share)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max(1, _verify_threads() - 1), thread_name_prefix="kv-crc"))
        return _pool[1]


def _block_crcs_range(pieces: Sequence[memoryview], block: int, first: int, last: int) -> list[int]:
    """CRC-32C of blocks first..last-1 of the concatenation of `pieces` (each block its own CRC)."""
    out: list[int] = []
    # Locate block `first`: walk pieces until its start offset.
    starts: list[int] = []
    pos = 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    total = pos
    for b in range(first, last):
        lo, hi = b * block, min((b + 1) * block, total)
        crc = 0
        for p, s in zip(pieces, starts):
            e = s + len(p)
            if e <= lo or s >= hi:
                continue
            crc = block_crc(p[max(lo, s) - s : min(hi, e) - s], crc)
        out.append(crc)
    return out


def block_checksums(pieces: Sequence[memoryview], block: int = CHECKSUM_BLOCK_BYTES) -> list[int]:
    """CRC-32C of each `block`-byte block of the concatenated `pieces` (the data section), in order.

    Blocks are split into one contiguous run per thread; the calling thread checks
    the first run while the pool checks the rest.
    """
    total = sum(len(p) for p in pieces)
    n_blocks = -(-total // block)
    threads = min(_verify_threads(), n_blocks)
    if threads <= 1:
        return _block_crcs_range(pieces, block, 0, n_blocks)
    bounds = [n_blocks * i // threads for i in range(threads + 1)]
    pool = _crc_pool()
    futures = [pool.submit(_block_crcs_range, pieces, block, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    out = _block_crcs_range(pieces, block, bounds[0], bounds[1])
    for f in futures:
        out.extend(f.result())
    return out


# (block size, a callable giving the CRC-32C of each block of the data section, in order):
# computed by a reader while it read the bytes (over the very buffer handed to decode).
BlockCrcs = tuple[int, Callable[[], list[int]]]


def _format_checksum(crcs: Sequence[int]) -> str:
    return f"{CHECKSUM_ALGO}:" + ",".join(f"{c:08x}" for c in crcs)


def encode(entry: KVEntry, compression: Compression = Compression.NONE,
           extra: Mapping[str, str] | None = None) -> bytes:
    """Serialize `entry` as one safetensors file's bytes.

    Args:
        entry: the chunk's KV (any device; it is copied to CPU for writing).
        compression: NONE keeps k and v bit-exact; the others store packed layer rows
            (`kvstore.compression`: INT8/FP8 per channel, INT4/INT2 in KIVI's groups).
        extra: more metadata (strings), covered by the header checksum, under names of its
            own (the KV tree's spilled nodes carry their place in the tree: engine.kv.node_files).
    """
    compression = check_supported(compression)
    tensors: dict[str, torch.Tensor] = {
        "token_ids": entry.token_ids.contiguous(),  # [T]
        "positions": entry.positions.contiguous(),  # [T]
    }
    v_is_k = entry.v is entry.k or torch.equal(entry.k, entry.v)  # MLA: the latent is both; store it once
    for name, x in (("k", entry.k),) if v_is_k else (("k", entry.k), ("v", entry.v)):
        if compression is Compression.NONE:
            tensors[name] = x.detach().to("cpu").contiguous()  # [L, Hkv, T, D]
        else:  # quantized where x is (the engine's device), then copied: a quarter of the bytes or less
            tensors[f"{name}_packed"] = pack(x.detach(), compression, name).to("cpu").contiguous()  # [L, B]
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "key": entry.key.to_str(),
        "model_fp": entry.model_fp,
        "tokenizer_fp": entry.tokenizer_fp,
        "prefix_hash": entry.prefix_hash,
        "rope_mode": entry.rope_mode.value,
        "dtype": str(entry.k.dtype).removeprefix("torch."),
        "compression": compression.value,
        "shape": ",".join(str(n) for n in entry.k.shape),
    }
    if entry.context_hash is not None:  # only context KV has it: plain files are byte-for-byte as before
        meta["context_hash"] = entry.context_hash
    if v_is_k:  # only then: other files are byte-for-byte as before
        meta["v_is_k"] = "true"
    for name, value in (extra or {}).items():
        if name in meta or name in _CHECKSUM_FIELDS or name == "checksum_block" or not isinstance(value, str):
            raise ValueError(f"extra metadata {name!r} clashes with the format's own fields or is not a string")
        meta[name] = value
    # safetensors' own order: widest dtype first (keeps every tensor aligned), then name.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    layout: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name in order:
        t = tensors[name]
        raw = _tensor_bytes(t)
        layout[name] = (_ST_NAMES[t.dtype], tuple(t.shape), offset, offset + len(raw))
        offset += len(raw)
        chunks.append(raw)
    meta["checksum_block"] = str(CHECKSUM_BLOCK_BYTES)
    meta["checksum"] = _format_checksum(block_checksums(chunks, CHECKSUM_BLOCK_BYTES))
    meta["header_checksum"] = _header_checksum(meta, layout)
    header: dict[str, object] = {"__metadata__": meta}
    for name, (dt, shape, start, end) in layout.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [start, end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return b"".join([struct.pack("<Q", len(blob)), blob, *chunks])


Layout = dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (dtype, shape, start, end) in the data section


def _parse_layout(buf: memoryview, file_size: int | None = None) -> tuple[dict[str, str], Layout]:
    """Split a safetensors buffer into metadata and tensor layout, checking every bound.

    `buf` may hold only the file's head (header included) when `file_size` gives the whole size.
    """
    size = len(buf) if file_size is None else file_size
    if size < 8 or len(buf) < 8:
        raise KVFormatError(f"file is {size} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise KVFormatError(f"header length {n} does not fit a {size}-byte file (truncated?)")
    if 8 + n > len(buf):
        raise KVFormatError(f"header length {n} is past the {len(buf)} bytes read: read more first")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KVFormatError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise KVFormatError("header has no __metadata__ object")
    meta = header.pop("__metadata__")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise KVFormatError("header metadata must map strings to strings")
    data_len = size - 8 - n
    layout: Layout = {}
    covered = 0
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise KVFormatError(f"tensor {name!r} has a malformed header entry: {info!r}") from None
        if dtype not in _ST_DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise KVFormatError(f"tensor {name!r} has dtype {dtype!r} / shape {shape!r} that we do not store")
        numel = 1
        for d in shape:
            numel *= d
        size = numel * _ST_DTYPES[dtype].itemsize
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start and end - start == size):
            raise KVFormatError(f"tensor {name!r} offsets {start}..{end} do not hold {size} bytes")
        if end > data_len:
            raise KVFormatError(f"tensor {name!r} ends at {end}, past the {data_len} data bytes (truncated?)")
        covered += size
        layout[name] = (dtype, shape, start, end)  # relative to the data section
    if covered != data_len:
        raise KVFormatError(f"tensors cover {covered} of {data_len} data bytes")
    return meta, layout


def data_start(head: bytes | bytearray | memoryview) -> int:
    """Offset of the data section, from a file's first 8 bytes (0 if they are missing)."""
    if len(head) < 8:
        return 0
    header_len: int = struct.unpack("<Q", head[:8])[0]
    return 8 + header_len


def read_meta(head: bytes | bytearray | memoryview, file_size: int) -> dict[str, str]:
    """A file's metadata strings from its first `data_start` bytes (not yet checked against
    its checksums: for listings); KVFormatError when malformed."""
    meta, _ = _parse_layout(memoryview(head), file_size)
    _header_from_meta(meta)
    return meta


def read_header(data: bytes | bytearray | memoryview) -> FileHeader:
    """Parse and check a file's metadata without verifying the checksum (cheap; for listings)."""
    meta, _ = _parse_layout(memoryview(data))
    return _header_from_meta(meta)


def _header_from_meta(meta: Mapping[str, str]) -> FileHeader:
    if meta.get("format") != FORMAT_NAME:
        raise KVFormatError(f"format {meta.get('format')!r} is not {FORMAT_NAME!r}")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise KVFormatError(
            f"file is format version {meta.get('format_version')!r}, this build reads only version "
            f"{FORMAT_VERSION} (another version's file: a miss, not damage)"
        )
    try:
        shape = tuple(int(s) for s in meta["shape"].split(","))
        header = FileHeader(
            key=ChunkKey.from_str(meta["key"]),
            model_fp=meta["model_fp"],
            tokenizer_fp=meta["tokenizer_fp"],
            compression=Compression(meta["compression"]),
            dtype=_TORCH_DTYPE_NAMES[meta["dtype"]],
            shape=shape,  # type: ignore[arg-type]
        )
    except (KeyError, ValueError) as e:
        raise KVFormatError(f"metadata field is missing or malformed: {e}") from None
    if len(header.shape) != 4:
        raise KVFormatError(f"shape {meta['shape']!r} is not L,Hkv,T,D")
    return header


def stored_block_crcs(meta: Mapping[str, str], data_len: int, key: ChunkKey) -> tuple[int, list[int]]:
    """(block size, the CRC-32C of each block) as the file's metadata lists them; KVFormatError if malformed."""
    try:
        block = int(meta["checksum_block"])
    except (KeyError, ValueError):
        raise KVFormatError(f"checksum_block {meta.get('checksum_block')!r} is missing or malformed") from None
    if not _MIN_BLOCK_BYTES <= block <= _MAX_BLOCK_BYTES:
        raise KVFormatError(f"checksum_block {block} is outside {_MIN_BLOCK_BYTES}..{_MAX_BLOCK_BYTES}")
    stored = meta.get("checksum", "")
    n_blocks = -(-data_len // block)
    if not stored.startswith(f"{CHECKSUM_ALGO}:") or len(stored) != len(CHECKSUM_ALGO) + 1 + max(0, 9 * n_blocks - 1):
        raise KVFormatError(f"checksum field does not list {n_blocks} {CHECKSUM_ALGO} blocks for key {key.hex}")
    try:
        crcs = [int(c, 16) for c in stored.split(":", 1)[1].split(",")] if n_blocks else []
    except ValueError:
        raise KVFormatError(f"checksum field of key {key.hex} holds a value that is not hex") from None
    return block, crcs


def _verify_data(
    meta: Mapping[str, str], data: memoryview, key: ChunkKey, precomputed: BlockCrcs | None = None
) -> None:
    """Check the data section against the per-block CRC-32C list in `meta`; raise KVFormatError."""
    block = stored_block_crcs(meta, len(data), key)[0]
    stored = meta["checksum"]
    n_blocks = -(-len(data) // block)
    if precomputed is not None and precomputed[0] == block:
        got = _format_checksum(precomputed[1]())
    else:
        got = _format_checksum(block_checksums([data], block))
    if got != stored:
        pairs = zip(got.split(":", 1)[1].split(","), stored.split(":", 1)[1].split(","))
        bad = next((str(i) for i, (a, b) in enumerate(pairs) if a != b), "?")
        raise KVFormatError(f"checksum mismatch for key {key.hex} in block {bad} of {n_blocks} ({block} bytes each)")


def decode(
    data: bytes | bytearray | memoryview,
    *,
    expected_key: ChunkKey,
    model_fp: str,
    tokenizer_fp: str,
    block_crcs: BlockCrcs | None = None,
    clock: DequantClock | None = None,
    shared: bool = False,
) -> KVEntry:
    """Verify and parse a file's bytes into a KVEntry.

    Tensors of an uncompressed file are views of `data` when it is writable (pass a
    bytearray to avoid a copy), or when `shared`.

    Args:
        data: the whole file.
        expected_key: the key the caller asked for; a file holding another key is rejected.
        model_fp: the store's model fingerprint; a file of another model is rejected.
        tokenizer_fp: the store's tokenizer fingerprint.
        block_crcs: CRC-32s of the data section's blocks, taken while `data` was read
            (used only when their block size is the file's; otherwise computed here).
        clock: adds the time spent dequantizing (a compressed file).
        shared: view `data` even when it is read-only: memory shared with other processes
            (an object in Ray's object store) that the caller keeps alive and nobody writes.
            The entry's tensors are then read-only in fact: writing one is a bug, as it is
            for any memory tier's entry.

    Raises:
        KVFormatError: truncated, corrupt, another model's or another key's file.
    """
    buf = memoryview(data)
    if buf.readonly and not shared:
        buf = memoryview(bytearray(buf))
    head = check_head(buf, expected_key=expected_key, model_fp=model_fp, tokenizer_fp=tokenizer_fp)
    _verify_data(head.meta, buf[head.base:], expected_key, block_crcs)
    return entry_views(buf, head, clock=clock)


@dataclass(frozen=True, slots=True)
class FileHead:
    """A file's header, parsed and checked against what the reader asked for (data not yet verified)."""

    meta: dict[str, str]
    layout: Layout
    header: FileHeader
    base: int  # file offset of the data section


def check_head(
    buf: memoryview, *, expected_key: ChunkKey, model_fp: str, tokenizer_fp: str, file_size: int | None = None
) -> FileHead:
    """Parse the header at the start of `buf` and check model, tokenizer, key and header checksum.

    Args:
        file_size: the whole file's size when `buf` holds only its head.

    Raises:
        KVFormatError: malformed, another model's or another key's file.
    """
    meta, layout = _parse_layout(buf, file_size)
    header = _header_from_meta(meta)
    if header.model_fp != model_fp or header.tokenizer_fp != tokenizer_fp:
        raise KVFormatError(
            f"file is for model {header.model_fp!r} / tokenizer {header.tokenizer_fp!r}, "
            f"the store serves {model_fp!r} / {tokenizer_fp!r}"
        )
    if header.key != expected_key:
        raise KVFormatError(f"file holds key {header.key.hex}, expected {expected_key.hex}")
    if meta.get("header_checksum") != _header_checksum(meta, layout):
        raise KVFormatError(f"header checksum mismatch for key {expected_key.hex}")
    return FileHead(meta, layout, header, data_start(buf))


def unpack_whole(rows: torch.Tensor, header: FileHeader, role: str, clock: DequantClock | None = None,
                 ) -> torch.Tensor:
    """A packed tensor's rows `[L, B]` dequantized `[L, Hkv, T, D]` in the header's dtype (KVFormatError
    when the rows do not hold the header's shape)."""
    check_packed(rows, header, role)
    n_layers, hkv, t, d = header.shape
    return unpack(rows, header.compression, role, (hkv, t, d), header.dtype, clock)


def check_packed(rows: torch.Tensor, header: FileHeader, role: str) -> None:
    """KVFormatError unless `rows` is `[L, B]` with B the row size of the header's format and shape."""
    n_layers, hkv, t, d = header.shape
    try:
        want = row_bytes(header.compression, role, hkv, t, d)
    except ValueError as e:
        raise KVFormatError(f"file of key {header.key.hex} cannot be unpacked: {e}") from None
    if tuple(rows.shape) != (n_layers, want) or rows.dtype != torch.uint8:
        raise KVFormatError(f"{role}_packed is {rows.dtype} {tuple(rows.shape)}, a {header.compression.value} "
                            f"file of shape {header.shape} holds uint8 ({n_layers}, {want})")


def tensor_view(buf: memoryview, head: FileHead, name: str) -> torch.Tensor:
    """Tensor `name` of the file in `buf`, as a view of its bytes (KVFormatError if absent)."""
    if name not in head.layout:
        raise KVFormatError(f"file has no tensor {name!r} (has {sorted(head.layout)})")
    dt, shape, s, e = head.layout[name]
    s, e = head.base + s, head.base + e
    if buf.readonly:  # shared memory (`decode`'s `shared`): torch warns that it cannot protect it
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=e - s, offset=s)  # [nbytes]
    else:
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=e - s, offset=s)  # [nbytes]
    return flat.view(_ST_DTYPES[dt]).view(shape)


def entry_views(buf: memoryview, head: FileHead, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                clock: DequantClock | None = None) -> KVEntry:
    """The entry whose tensors view (uncompressed) or are decoded from (compressed) `buf`.

    `buf` is the whole file, writable (or shared: `decode`); the caller has verified what it will read.

    Args:
        kv: (k, v) to hand out in place of the file's (a layered read of a compressed file
            fills them layer by layer); None = the file's.
        clock: adds the time spent dequantizing.
    """
    meta, layout, header = head.meta, head.layout, head.header
    expected_key = header.key

    def tensor(name: str) -> torch.Tensor:
        return tensor_view(buf, head, name)

    v_is_k = meta.get("v_is_k") == "true"
    context_hash = meta.get("context_hash")  # set for neighbour-conditioned KV
    if kv is not None:
        k, v = kv  # [L, Hkv, T, D] each
    elif header.compression is Compression.NONE:
        k = tensor("k")  # [L, Hkv, T, D]
        v = k if v_is_k else tensor("v")
    elif "k_packed" in layout:
        k = unpack_whole(tensor("k_packed"), header, "k", clock)  # [L, Hkv, T, D]
        v = k if v_is_k else unpack_whole(tensor("v_packed"), header, "v", clock)  # [L, Hkv, T, D]
    else:  # the layout before packed rows (int8 / fp8 only)
        k = dequantize(tensor("k_q"), tensor("k_scale"), header.dtype)  # [L, Hkv, T, D]
        v = k if v_is_k else dequantize(tensor("v_q"), tensor("v_scale"), header.dtype)  # [L, Hkv, T, D]
    if tuple(k.shape) != header.shape or k.dtype != header.dtype:
        raise KVFormatError(f"k is {k.dtype} {tuple(k.shape)}, metadata says {header.dtype} {header.shape}")
    try:
        return KVEntry(
            key=header.key,
            k=k,
            v=v,
            token_ids=tensor("token_ids"),
            positions=tensor("positions"),
            model_fp=header.model_fp,
            tokenizer_fp=header.tokenizer_fp,
            prefix_hash=check_prefix_hash(meta.get("prefix_hash", "")),
            rope_mode=RopeMode(meta.get("rope_mode", "")),
            context_hash=ContextHash(context_hash) if context_hash else None,
        )
    except (TypeError, ValueError) as e:
        raise KVFormatError(f"file for key {expected_key.hex} does not form a valid entry: {e}") from None
