"""Layer-ordered reads of a chunk file: its layers become usable one by one.

A blend needs layer l of every chunk only when it reaches layer l, so a durable tier
can hand an entry out as soon as the file's header is checked and fill K and V behind
compute, in layer order (layer-wise pipelining). The data section is read as two
sequential streams, one through k's bytes and one through v's (v follows k in every
file we write), so layer l's K and V arrive together. Each checksum block is verified
the moment it is whole, and layer l is published only once every block holding any of
its bytes has passed. A block that fails, or a read that fails, stops the stream:
`LayerGate.wait` raises for that layer and every later one, and the tier takes the
file out of service.

A compressed file streams the same way: its K and V are packed layer rows (`k_packed`,
`v_packed` `[L, B]`, kvstore.compression), so layer l's bytes are one contiguous run of
each stream. Once they pass, the layer is published as verified, and the first thread to
`wait` on it (the engine's, which reads it next) moves its rows to `device` (the engine's)
and dequantizes them there into preallocated `[L, Hkv, T, D]` tensors: dequantization runs
where the prompt pass runs, in layer order, between its layers, not on the reading threads
beside it (eight of those, one a chunk, dequantizing side by side took the prompt pass's
cores: `docs/kv-compression.md`). The prompt pass starts on layer 0 while later layers are
still arriving. The entry is handed on whole (`on_done`: promotion to a memory tier) once
every layer is verified and dequantized, on a reading thread. Files this cannot
stream (int8 / fp8 files of the layout before packed rows, or a layout we did not
write) are read whole before they are handed out.

Knows nothing of where the bytes live: a tier supplies a `ByteSource`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ragkv.errors import KVFormatError, StoreError
from ragkv.kvstore.compression import Compression, DequantClock, unpack
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.fileformat import (
    FileHead,
    block_crc,
    check_head,
    check_packed,
    data_start,
    decode,
    entry_views,
    stored_block_crcs,
    tensor_view,
)
from ragkv.kvstore.keys import ChunkKey

HEAD_BYTES = 1 << 16  # first read: the header of any file we write, and the start of k


class RangeReader(Protocol):
    """Sequential reads through one byte range of a file."""

    def readinto(self, view: memoryview) -> int:
        """Fill the start of `view` with the next bytes; 0 only at the range's end."""


class ByteSource(Protocol):
    """Random access to one stored file, as a tier provides it."""

    size: int  # the file's length in bytes

    def reader(self, start: int, end: int) -> RangeReader:
        """A reader through bytes [start, end)."""

    def close(self) -> None:
        """Release the file (called once, after the last read)."""


class LayerGate:
    """How many of a chunk's layers hold verified data. Wait on it before reading a layer."""

    def __init__(self, num_layers: int, fill: Callable[[int], None] | None = None) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._ready = 0  # layers [0, ready) are verified (and filled, without `fill`)
        self._error: BaseException | None = None
        self._futures: dict[int, Future[None]] = {}  # layer -> done once layers [0, layer] are (when_ready)
        # fills layers [0, layer] on the waiter's thread once they are verified (a compressed
        # read dequantizes them: `_Unpacker.fill`); None: publishing fills them
        self._fill = fill
        self._filled: Future[None] = Future()  # done once every layer is filled (or the read failed)

    @classmethod
    def complete(cls, num_layers: int) -> LayerGate:
        gate = cls(num_layers)
        gate._ready = num_layers
        gate._filled.set_result(None)
        return gate

    @property
    def ready(self) -> int:
        """Layers [0, ready) may be read now."""
        with self._cond:
            return self._ready

    @property
    def error(self) -> BaseException | None:
        with self._cond:
            return self._error

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Block until layers [0, layer] are verified, then fill those not filled yet on this
        thread (a compressed read dequantizes them here); they may be read on return.

        Raises:
            KVFormatError: a block holding this layer failed its checksum (StoreError: the read failed).
            TimeoutError: not ready within `timeout` seconds.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ready <= layer:
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"layer {layer} not read within {timeout} s ({self._ready} ready)")
                self._cond.wait(left)
        if self._fill is not None:
            self._fill(layer)

    def wait_all(self, timeout: float | None = None) -> None:
        self.wait(self.num_layers - 1, timeout)

    def when_ready(self, layer: int) -> Future[None] | None:
        """None when layers [0, layer] may be read now, after `wait` (or the read failed: `wait`
        raises it); else a future done once they may be, or once the read fails. For a scheduler
        that parks the request instead of blocking its thread."""
        with self._cond:
            if self._ready > layer or self._error is not None:
                return None
            return self._futures.setdefault(layer, Future())

    def when_filled(self) -> Future[None]:
        """Done once every layer is verified and filled, or with the read's error once it fails;
        a layer that nobody waits on is never dequantized, so this may never be done. (A callback
        on it should not hold the gate: the future is the gate's own, so that would be a cycle
        keeping the chunk's tensors until the garbage collector runs.)"""
        return self._filled

    def filled(self, error: BaseException | None = None) -> None:
        """Every layer is verified and filled (the read's last step), or `error` ended the read."""
        if self._filled.done():
            return
        if error is None:
            self._filled.set_result(None)
        else:
            self._filled.set_exception(error)

    def publish(self, ready: int) -> None:
        with self._cond:
            self._ready = max(self._ready, ready)
            self._cond.notify_all()
            done = [self._futures.pop(layer) for layer in list(self._futures) if layer < self._ready]
        for fut in done:
            fut.set_result(None)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
            done = list(self._futures.values())
            self._futures.clear()
        for fut in done:  # the waiter resumes and finds the error in `wait`
            fut.set_result(None)
        self.filled(error)


class _Stream:
    """One sequential read through a run of checksum blocks, verifying each as it completes."""

    def __init__(self, source: ByteSource, buf: memoryview, base: int, block: int, crcs: list[int],
                 first_block: int, end_block: int, filled: int, key: ChunkKey) -> None:
        self.buf, self.base, self.block, self.crcs, self.key = buf, base, block, crcs, key
        self.end = min(len(buf), base + end_block * block)  # file offset where this stream stops
        self.filled = min(max(filled, base + first_block * block), self.end)  # bytes before it are in buf
        self.next_block = first_block  # the first block not yet verified
        self._reader = source.reader(self.filled, self.end) if self.filled < self.end else None

    def block_end(self, b: int) -> int:
        return min(len(self.buf), self.base + (b + 1) * self.block)

    def advance(self, upto_block: int) -> None:
        """Read and verify through block `upto_block` (one of this stream's)."""
        while self.next_block <= upto_block:
            b = self.next_block
            stop = self.block_end(b)
            while self.filled < stop:
                got = self._reader.readinto(self.buf[self.filled:stop]) if self._reader is not None else 0
                if not got:
                    raise KVFormatError(f"file of key {self.key.hex} ended at byte {self.filled}, "
                                        f"before block {b} was whole (truncated?)")
                self.filled += got
            lo = self.base + b * self.block
            if block_crc(self.buf[lo:stop]) != self.crcs[b]:
                raise KVFormatError(f"checksum mismatch for key {self.key.hex} in block {b} of "
                                    f"{len(self.crcs)} ({self.block} bytes each)")
            self.next_block += 1


def read_layered(
    source: ByteSource,
    *,
    expected_key: ChunkKey,
    model_fp: str,
    tokenizer_fp: str,
    spawn: Callable[[Callable[[], None]], object],
    on_done: Callable[[memoryview, KVEntry], object],
    on_fail: Callable[[BaseException], None],
    device: torch.device | None = None,
    clock: DequantClock | None = None,
) -> tuple[KVEntry, LayerGate]:
    """Start reading `source`; return its entry (k and v filling in) and the gate that says how far.

    The header and the blocks holding token_ids and positions are read and verified
    here; `spawn(job)` runs the rest in the background (closing the source at the end).

    Args:
        spawn: runs a callable on another thread (an executor's submit).
        on_done: called from that thread with the whole verified file and its entry.
        on_fail: called from that thread when a block or a read fails, before the gate says so.
        device: where a compressed file's layers are dequantized and held (the engine's
            device; default CPU). An uncompressed file's tensors stay views of the read buffer.
        clock: adds the time spent dequantizing (by the time `on_done` runs).

    Raises:
        KVFormatError: the header is bad or another model's / key's; the source is closed.
        OSError, StoreError: the first reads failed; the source is closed.
    """
    try:
        buf_t = torch.empty(source.size, dtype=torch.uint8)  # [nbytes], uninitialized: no zero-fill pass
        buf = buf_t.numpy().data  # its buffer, as memoryview(array) gives it
        head_len = _fill(source, buf, 0, min(source.size, HEAD_BYTES))
        base = data_start(buf[:head_len])
        if head_len < base <= source.size:  # a header longer than the first read
            head_len = _fill(source, buf, head_len, base)
        head = check_head(buf[:head_len], expected_key=expected_key, model_fp=model_fp,
                          tokenizer_fp=tokenizer_fp, file_size=source.size)
        block, crcs = stored_block_crcs(head.meta, source.size - base, expected_key)
        plan = _block_layout(head, block)
        if plan is None:  # not streamable: read the rest and verify it whole
            _fill(source, buf, head_len, source.size)
            entry = decode(buf, expected_key=expected_key, model_fp=model_fp, tokenizer_fp=tokenizer_fp,
                           clock=clock)
            source.close()
            on_done(buf, entry)
            return entry, LayerGate.complete(entry.k.shape[0])
        k_stream = _Stream(source, buf, base, block, crcs, 0, plan.v_first_block, head_len, expected_key)
        v_stream = _Stream(source, buf, base, block, crcs, plan.v_first_block, len(crcs), head_len, expected_key)
        k_stream.advance(plan.prelude_block)  # token_ids and positions: the entry checks its key with them
        unpacker = _Unpacker.of(buf, head, device, clock) if head.header.compression is not Compression.NONE else None
        entry = entry_views(buf, head, None if unpacker is None else (unpacker.k, unpacker.v))
    except BaseException:
        source.close()
        raise
    gate = LayerGate(plan.num_layers, None if unpacker is None else unpacker.fill)

    def whole() -> None:  # every layer verified and filled: hand the entry on
        gate.filled()
        on_done(buf, entry)

    def run() -> None:
        try:
            for layer in range(plan.num_layers):
                for need in (plan.k_blocks[layer], plan.v_blocks[layer]):
                    (k_stream if need < plan.v_first_block else v_stream).advance(need)
                gate.publish(layer + 1)  # verified: its first waiter dequantizes it (a compressed file)
            k_stream.advance(plan.v_first_block - 1)  # bytes past the last layer, if any
            v_stream.advance(len(crcs) - 1)
        except Exception as e:  # damage (KVFormatError), or an I/O failure, which is not damage: keep the file
            err = e if isinstance(e, KVFormatError) else StoreError(
                f"reading key {expected_key.hex} failed after {gate.ready} layers: {e}")
            # the tier acts first (quarantine), then the waiter hears of it: a waiter that
            # recomputes and writes the chunk back must find the bad file gone, not lose its own
            try:
                on_fail(err)
            finally:
                gate.fail(err)
            return
        finally:
            source.close()
        if unpacker is None:
            whole()
        else:  # now, or once a waiter has dequantized the last layer: on a thread of the reads', not the waiter's
            unpacker.verified(lambda: spawn(whole))

    spawn(run)
    return entry, gate


@dataclass
class _Unpacker:
    """A compressed file's K and V `[L, Hkv, T, D]` on `device`, dequantized one layer at a time
    from the packed rows (views of the read buffer), in layer order, by the threads that wait on
    them (`fill`, the gate's hook); `verified(then)` runs `then` once the reader has verified every
    layer and they are all dequantized, on whichever thread gets there last."""

    head: FileHead
    k_rows: torch.Tensor  # [L, Bk] uint8, a view of the buffer
    v_rows: torch.Tensor | None  # [L, Bv] uint8; None: v is k (one latent as both)
    k: torch.Tensor  # [L, Hkv, T, D] in the file's dtype, filled layer by layer
    v: torch.Tensor  # [L, Hkv, T, D], or k itself
    clock: DequantClock | None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: int = 0  # layers [0, done) dequantized
    _then: Callable[[], object] | None = None  # `verified`'s, until every layer is done

    @classmethod
    def of(cls, buf: memoryview, head: FileHead, device: torch.device | None,
           clock: DequantClock | None) -> _Unpacker:
        header = head.header
        k_rows = tensor_view(buf, head, "k_packed")  # [L, Bk]
        check_packed(k_rows, header, "k")
        v_rows = tensor_view(buf, head, "v_packed") if "v_packed" in head.layout else None  # [L, Bv]
        if v_rows is not None:
            check_packed(v_rows, header, "v")
        k = torch.empty(header.shape, dtype=header.dtype, device=device or "cpu")  # [L, Hkv, T, D]
        return cls(head, k_rows, v_rows, k, k if v_rows is None else torch.empty_like(k), clock)

    def fill(self, upto: int) -> None:
        """Dequantize layers [0, upto] not dequantized yet (their rows have passed their checksums)."""
        then = None
        with self._lock:
            while self._done <= upto:
                self.layer(self._done)
                self._done += 1
            if self._done == self.k.shape[0]:
                then, self._then = self._then, None
        if then is not None:
            then()

    def verified(self, then: Callable[[], object]) -> None:
        """Every layer has passed: `then()` now if all are dequantized, else after the last is."""
        with self._lock:
            if self._done < self.k.shape[0]:
                self._then = then
                return
        then()

    def layer(self, i: int) -> None:
        """Dequantize layer i (its rows have passed their checksums) into k[i] and v[i]."""
        compression, (_, hkv, t, d), dtype = self.head.header.compression, self.head.header.shape, self.k.dtype
        for rows, out, role in ((self.k_rows, self.k, "k"), (self.v_rows, self.v, "v")):
            if rows is None:
                continue
            row = rows[i:i + 1].to(out.device)  # [1, B]: the packed bytes move, not the dequantized ones
            unpack(row, compression, role, (hkv, t, d), dtype, self.clock, out=out[i:i + 1])  # into [1, Hkv, T, D]


@dataclass(frozen=True, slots=True)
class _BlockLayout:
    """Which checksum block each layer's last K and V bytes sit in."""

    num_layers: int
    k_blocks: list[int]  # [L] block holding the last byte of k's layer l
    v_blocks: list[int]  # [L] block holding the last byte of v's layer l
    v_first_block: int  # the block v starts in: the v stream's first
    prelude_block: int  # the last block holding token_ids / positions (-1: none)


def _block_layout(head: FileHead, block: int) -> _BlockLayout | None:
    """The layer plan of a file laid out as we write it (k and v, or their packed rows, layer-major
    after the rest), else None (read it whole)."""
    layout = head.layout
    kn, vn = ("k", "v") if head.header.compression is Compression.NONE else ("k_packed", "v_packed")
    v_is_k = vn not in layout and head.meta.get("v_is_k") == "true"  # one latent as both (MLA): k's stream only
    if kn not in layout or (vn not in layout and not v_is_k):
        return None
    _, _, k_start, k_end = layout[kn]
    others_end = max((e for n, (_, _, _, e) in layout.items() if n not in (kn, vn)), default=0)
    num_layers = head.header.shape[0]
    if not others_end <= k_start < k_end or num_layers < 1:
        return None
    per_layer = (k_end - k_start) // num_layers
    k_blocks = [(k_start + (i + 1) * per_layer - 1) // block for i in range(num_layers)]
    if v_is_k:  # v's layers are k's blocks; the "v stream" starts past the last block and reads nothing
        v_blocks, v_first = k_blocks, (k_end - 1) // block + 1
    else:
        _, _, v_start, v_end = layout[vn]
        if not k_end <= v_start < v_end:
            return None
        v_per_layer = (v_end - v_start) // num_layers  # packed V rows differ in size from K's
        v_blocks = [(v_start + (i + 1) * v_per_layer - 1) // block for i in range(num_layers)]
        v_first = v_start // block
    prelude = (others_end - 1) // block if others_end else -1
    if prelude >= v_first:
        return None
    return _BlockLayout(num_layers, k_blocks, v_blocks, v_first, prelude)


def _fill(source: ByteSource, buf: memoryview, start: int, end: int) -> int:
    """Read bytes [start, end) into buf; returns end. KVFormatError if the file is shorter."""
    reader = source.reader(start, end)
    pos = start
    while pos < end:
        got = reader.readinto(buf[pos:end])
        if not got:
            raise KVFormatError(f"file ended at byte {pos} of {end} (truncated?)")
        pos += got
    return end
