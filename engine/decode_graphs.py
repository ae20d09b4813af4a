"""Decode over the decode pool: one shape-static step per batch bucket, captured as a CUDA graph.

`decode_batch` (engine/decode.py) is ragged: each request's cache is a tensor of its own, and
attention runs once per request. That is the fastest CPU path (a decode step's attention is
bound by reading each cache once; measured in bench/batch_decode_bench.py), and it cannot be
captured: every step has new shapes, and the host decides per request. On a GPU a decode step
is launch-bound (68 ms a step with the device busy for 13 on an H200, issue 70), so this
module runs the step another way:

- every decoding request's KV lives in one `DecodePool` (`engine.kv.decode_pool`), a request
  being a run of slots `[start, start + length)` in tensors that never move;
- a step pads its B requests up to a bucket (1, 2, 4, ... 64) and reads everything that
  varies (tokens, positions, write slots, runs, lengths) from device buffers, so the same
  kernels with the same shapes run each step: all requests' attention is one SDPA call per
  layer over their runs, gathered to the bucket's key width with a length mask;
- with graphs on (CUDA only), the step of each (batch bucket, key bucket) is captured once
  and replayed: a step is one launch, and the host only copies its inputs in and the logits out.

Padded rows write their K/V into the pool's scratch page and attend to it alone. Families
whose layers need more than that (windows, soft-capping, sinks, latent or recurrent layers,
Gemma 4's shared KV) keep the ragged path: `unsupported_reason` says why, and `docs/models.md`
lists them. A step the pool cannot hold (no room, more rows than the largest bucket), and a
bucket whose capture failed, run eagerly or ragged, and `DecodeStats` counts each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ragkv.engine.decode import decode_batch
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.kv.decode_pool import DecodePool, DecodePoolFullError

if TYPE_CHECKING:
    from ragkv.engine.family import Adapter
    from ragkv.engine.model_loading import LoadedModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a step's rows are padded up to one of these
MIN_KEY_BUCKET = 256  # key widths are powers of two from here: few shapes, at most 2x the keys read


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """How an engine decodes (`ragkv serve --cuda-graphs`, `--decode-pool`)."""

    pool: str = "auto"  # decode over one pool: "auto" = on CUDA, where a step is launch-bound; "on"; "off"
    cuda_graphs: str = "auto"  # capture each bucket's step: "auto" = wherever the pool is used on CUDA; "off"
    # the pool's K and V bytes: the requests' KV and the KV tree's device tier, which reserves none of
    # it (`DecodePool.share`); requests that do not fit decode ragged
    pool_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.pool not in ("auto", "on", "off"):
            raise ValueError(f"decode pool must be auto, on or off, got {self.pool!r}")
        if self.cuda_graphs not in ("auto", "off"):
            raise ValueError(f"cuda graphs must be auto or off, got {self.cuda_graphs!r}")
        if self.pool_bytes < 1:
            raise ValueError(f"decode pool bytes must be > 0, got {self.pool_bytes}")

    def decoder(self, lm: LoadedModel) -> PooledDecoder | None:
        """The pooled decoder these settings give `lm`, or None (ragged decode): pool "off", "auto"
        off CUDA, or a family that cannot decode over the pool (logged, with why)."""
        if self.pool == "off" or (self.pool == "auto" and lm.device.type != "cuda"):
            return None
        reason = unsupported_reason(lm.adapter)
        if reason is not None:
            log.info("%s decodes ragged, not over the decode pool: %s", lm.adapter.family.model_type, reason)
            return None
        token_bytes = 2 * lm.kv_layers * lm.num_kv_heads * lm.head_dim * lm.dtype.itemsize
        return PooledDecoder(lm, max(self.pool_bytes // token_bytes, 2 * 16), graphs=self.cuda_graphs == "auto")


def unsupported_reason(ad: Adapter) -> str | None:
    """Why this model cannot decode over the pool (it decodes ragged), or None when it can."""
    fam = ad.family
    if ad.recurrent_layers:
        return "recurrent layers carry a state per request, not KV"
    if fam.mla:
        return "latent attention's cache is one latent head, read through per-head projections"
    if fam.gemma4 or ad.per_layer_input:
        return "Gemma 4's layers read other layers' KV and per-layer inputs"
    if any(not a.is_global for a in ad.attention):
        return "sliding-window or chunked layers need a mask per layer kind"
    if any(a.softcap is not None or a.sinks is not None for a in ad.attention):
        return "soft-capped or sink attention is not SDPA's"
    return None


def bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket that holds n rows; None past the largest."""
    return next((b for b in buckets if b >= n), None)


def key_bucket(n: int) -> int:
    """Key width for n keys: a power of two, at least MIN_KEY_BUCKET."""
    width = MIN_KEY_BUCKET
    while width < n:
        width *= 2
    return width


@dataclass(slots=True)
class DecodeStats:
    """What the pooled decoder did, for the server's metrics and the benches."""

    graph_steps: int = 0  # steps replayed from a captured graph
    eager_steps: int = 0  # pooled steps run eagerly (graphs off, or a bucket that failed to capture)
    ragged_steps: int = 0  # steps with rows decoded ragged (the pool had no room for them, or too many rows)
    left_pool: int = 0  # requests whose run could not grow: their KV copied out, decoding ragged until there is room
    captures: int = 0  # graphs captured
    capture_failures: int = 0  # buckets whose capture failed (they run eagerly)
    capture_s: float = 0.0  # seconds spent capturing


@dataclass(slots=True)
class _Inputs:
    """A bucket's device buffers: every value a step reads that changes between steps."""

    tokens: torch.Tensor  # [Bb] int64 the token each row feeds
    pos: torch.Tensor  # [Bb] int64 its position (= its cache length before the step)
    slots: torch.Tensor  # [Bb] int64 the pool slot its K/V is written to
    starts: torch.Tensor  # [Bb] int64 its run's first slot
    lens: torch.Tensor  # [Bb] int64 keys it attends to (its length after the write)
    keys: torch.Tensor  # [Kb] int64 0..Kb-1, the key offsets within a run

    @classmethod
    def empty(cls, rows: int, keys: int, device: torch.device) -> _Inputs:
        z = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(z.clone(), z.clone(), z.clone(), z.clone(), z.clone() + 1,
                   torch.arange(keys, device=device))


@dataclass(slots=True)
class _Bucket:
    inputs: _Inputs
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [Bb, V] the graph's output buffer
    failed: bool = False  # capture failed: this bucket runs eagerly


class PooledDecoder:
    """Decode steps over one `DecodePool`; CUDA graphs per bucket when `graphs` and on CUDA."""

    def __init__(self, lm: LoadedModel, pool_tokens: int, graphs: bool = True) -> None:
        reason = unsupported_reason(lm.adapter)
        if reason is not None:
            raise ValueError(f"{lm.adapter.family.model_type} cannot decode over the pool: {reason}")
        self.lm = lm
        self.pool = DecodePool(lm.kv_layers, lm.num_kv_heads, lm.head_dim, pool_tokens, lm.dtype, lm.device)
        self.graphs = graphs and lm.device.type == "cuda"
        self.stats = DecodeStats()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool_graphs = torch.cuda.graph_pool_handle() if self.graphs else None

    def warm(self, batches: tuple[int, ...] = BATCH_BUCKETS, keys: int = MIN_KEY_BUCKET) -> int:
        """Capture the step of each batch bucket at `keys` ahead of the first request (server
        start-up: its time is logged with the rest of loading); every row a padded one, writing
        and reading the scratch page. Returns the graphs captured (0 with graphs off)."""
        if not self.graphs:
            return 0
        before = self.stats.captures
        with torch.inference_mode():
            for rows in batches:
                b = self._buckets.setdefault((rows, keys), _Bucket(_Inputs.empty(rows, keys, self.lm.device)))
                self._fill(b.inputs, [], [], [], rows)
                if b.graph is None and not b.failed:
                    self._capture(b)
        return self.stats.captures - before

    def release(self, cache: KVCache) -> None:
        """A request ended: its run goes back to the pool, its KV with it (no copy out)."""
        self.pool.release(cache, keep=False)

    @torch.inference_mode()
    def step(self, caches: list[KVCache], tokens: list[int]) -> torch.Tensor:
        """One decode step for B requests, as `decode_batch` (same arguments, [B, V] float32 logits).

        The requests the pool holds (or takes now) decode over it, up to the largest bucket; the
        rest (no room, or past the largest bucket) decode ragged beside them in the same step, so
        a pool too small for everyone slows only those it cannot hold."""
        inside = self._admit(caches)[:BATCH_BUCKETS[-1]]
        if not inside:
            self.stats.ragged_steps += 1
            return decode_batch(self.lm, caches, tokens)
        if len(inside) == len(caches):
            return self._pooled(caches, tokens)
        outside = sorted(set(range(len(caches))) - set(inside))
        pooled = self._pooled([caches[i] for i in inside], [tokens[i] for i in inside])  # [B_in, V]
        self.stats.ragged_steps += 1
        ragged = decode_batch(self.lm, [caches[i] for i in outside], [tokens[i] for i in outside])  # [B_out, V]
        logits = pooled.new_empty(len(caches), pooled.shape[1])  # [B, V]
        logits[inside], logits[outside] = pooled, ragged.to(pooled.device)
        return logits

    def _pooled(self, caches: list[KVCache], tokens: list[int]) -> torch.Tensor:
        """The step of requests the pool holds, with room for their token: [B, V] float32 logits."""
        n = len(caches)
        rows = bucket(n)
        assert rows is not None, "more pooled rows than the largest bucket: a bug"
        lens = [c.length for c in caches]
        keys = key_bucket(max(lens) + 1)
        b = self._buckets.get((rows, keys))
        if b is None:
            b = self._buckets[(rows, keys)] = _Bucket(_Inputs.empty(rows, keys, self.lm.device))
        self._fill(b.inputs, caches, tokens, lens, rows)
        if self.graphs and not b.failed:
            if b.graph is None:
                self._capture(b)
            if b.graph is not None and b.logits is not None:
                b.graph.replay()
                self.stats.graph_steps += 1
                logits = b.logits[:n].clone()
                self._advance(caches, lens)
                return logits
        self.stats.eager_steps += 1
        logits = self._forward(b.inputs)[:n]
        self._advance(caches, lens)
        return logits

    def _admit(self, caches: list[KVCache]) -> list[int]:
        """The rows whose caches are in the pool with room for this step's token (one already
        there grows when its run is full; one outside moves in when a run is free)."""
        inside = []
        for i, c in enumerate(caches):
            try:  # room for this step's token: a cache from outside moves in at its length, not at the
                # capacity its own growth reserved (up to twice that), and grows in the pool as it decodes
                self.pool.admit(c, c.length + 1)
            except DecodePoolFullError as exc:
                log.debug("decode pool full, a request decodes ragged this step: %s", exc)
                if self.pool.run_of(c) is not None:  # its run is full and cannot grow: its KV leaves
                    self.pool.release(c)  # the pool (copied out) and comes back when a run is free
                    self.stats.left_pool += 1
                continue
            inside.append(i)
        return inside

    def _fill(self, x: _Inputs, caches: list[KVCache], tokens: list[int], lens: list[int], rows: int) -> None:
        """The step's values into the bucket's buffers, in one host-to-device copy; padded rows
        feed token 0 at position 0 into the scratch page."""
        pool, pad = self.pool, rows - len(caches)
        starts = [self.pool.run_of(c).start for c in caches]  # type: ignore[union-attr]
        values = torch.tensor([
            [*tokens, *[0] * pad],
            [*lens, *[0] * pad],
            [s + n for s, n in zip(starts, lens)] + [pool.scratch] * pad,
            [*starts, *[pool.scratch] * pad],
            [n + 1 for n in lens] + [1] * pad,
        ], dtype=torch.long)  # [5, Bb]
        staged = values.to(x.tokens.device, non_blocking=True)
        for buf, row in zip((x.tokens, x.pos, x.slots, x.starts, x.lens), staged):
            buf.copy_(row)

    @staticmethod
    def _advance(caches: list[KVCache], lens: list[int]) -> None:
        for c, n in zip(caches, lens):
            c.length = n + 1

    def _forward(self, x: _Inputs) -> torch.Tensor:
        """The step itself: device ops only, the same shapes every call of a bucket. -> [Bb, V] float32."""
        lm, ad, pool = self.lm, self.lm.adapter, self.pool
        rows, hq, hk, d = x.tokens.shape[0], ad.num_heads, ad.num_kv_heads, ad.head_dim
        h = ad.embed(x.tokens)  # [Bb, hidden]
        rope = ad.rotary(x.pos, torch.empty(0, dtype=lm.dtype, device=lm.device))
        idx = (x.starts[:, None] + x.keys[None, :]).clamp_(max=pool.k.shape[2] - 1)  # [Bb, Kb] pool slots
        mask = (x.keys[None, :] < x.lens[:, None])[:, None, None, :]  # [Bb, 1, 1, Kb]
        for i in range(lm.num_layers):
            xi = ad.attn_input(i, h)
            q, k, v = ad.qkv(i, xi)  # [H, Bb, D], [Hkv, Bb, D] x 2
            q, k_rot = rope.scale_query(rope.apply(q, i), i), rope.apply(k, i)
            if ad.folds_key_norm:
                q = ad.fold_key_norm(i, q)
            c = ad.cache_layer[i]
            pool.k[c].index_copy_(1, x.slots, k_rot)
            pool.v[c].index_copy_(1, x.slots, v)
            keys = pool.k[c][:, idx].transpose(0, 1)  # [Bb, Hkv, Kb, D]
            values = pool.v[c][:, idx].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[:, :, None],  # [Bb, H, 1, D]
                keys, values, attn_mask=mask, scale=ad.attention[i].scaling, enable_gqa=hq != hk,
            )  # [Bb, H, 1, D]
            h = ad.residual(i, h, xi, ad.attn_output(i, out.reshape(rows, hq * d), xi))
        return ad.logits(h)  # [Bb, V]

    def _capture(self, b: _Bucket) -> None:
        """Capture the bucket's step (after two eager warm-up runs on a side stream, as CUDA
        graphs need); a failure leaves the bucket eager, counted and logged once."""
        t0 = time.perf_counter()
        try:  # the warm-ups write the step's own K/V at its own slots, as the replay will again
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(b.inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool_graphs):
                b.logits = self._forward(b.inputs)
            b.graph = graph
            self.stats.captures += 1
        except Exception as exc:  # a kernel that cannot be captured: this bucket runs eagerly
            b.failed, b.graph, b.logits = True, None, None
            self.stats.capture_failures += 1
            log.warning("decode graph for %d rows x %d keys not captured, it runs eagerly: %s",
                        b.inputs.tokens.shape[0], b.inputs.keys.shape[0], exc)
        finally:
            self.stats.capture_s += time.perf_counter() - t0
